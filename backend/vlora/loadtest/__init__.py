"""Load tests with locust: vision workloads against a real vlora Triton server, and reports.

- ``workload``: workload definitions (``configs/workloads/*.yaml``) as frozen dataclasses;
- ``generators``: seeded request generators (visual retrieval, video analytics), adapter popularity;
- ``heads``: the one switch between task-head requests and generated labels;
- ``transport`` / ``grpc_worker``: sending and timing requests (gRPC streaming, HTTP generate);
- ``locustfile``: the locust users; ``runner``: one run or a sweep; ``scrape``: the server's metrics;
- ``summary`` / ``report``: the numbers, plots and markdown; ``cli``: ``vlora loadtest``.
"""
