"""Load tests with locust: vision workloads against a real vlora Triton server, and reports. A client tool: it
imports vlora (settings, demo adapters, the launcher), and vlora never imports it.

- ``workload``: workload definitions (``workloads/*.yaml``, linked from ``configs/workloads``) as frozen dataclasses;
- ``generators``: seeded request generators (visual retrieval, video analytics), adapter popularity;
- ``heads``: the one switch between task-head requests and generated labels;
- ``transport`` / ``grpc_worker``: sending and timing requests (gRPC streaming, HTTP generate);
- ``locustfile``: the locust users; ``runner``: one run or a sweep; ``scrape``: the server's metrics;
- ``summary`` / ``report``: the numbers, plots and markdown; ``cli``: ``vlora loadtest``.
"""
