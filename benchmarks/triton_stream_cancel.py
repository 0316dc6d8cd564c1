"""Does tritonserver stop cleanly after gRPC streams that were cancelled as their last responses came? A check of
Triton itself, with no vlora code in the server: a decoupled Python model that sends three responses (the last
with the final flag), N gRPC streams that each read two of them and are then stopped with
``stop_stream(cancel_requests=True)``, then SIGTERM. The same again with the streams closed without cancelling,
as the control.

    python -m benchmarks.triton_stream_cancel [--streams 6000] [--exit-timeout 15]

Triton 2.51 (the nvidia-pytriton wheel `vlora serve` runs) exits 1 after the cancelled streams: "Found 0 model
versions that have in-flight inferences", then "Found 1 live models" until the exit timeout, and the model's
finalize() never runs; after the closed ones it stops in about 3 s. Something on Triton's side keeps a reference
to the model after such a cancellation. `benchmarks/soak.py` meets it at the end of a 30-minute run (its clients
leave streams mid-answer; every request had its final flag, as the model's wire.OpenSenders showed). Writes
``results/triton-stream-cancel-<device>.json`` and a RESULTS line (unless ``--no-record``).
"""
from __future__ import annotations

import argparse
import queue
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, git_commit, write_result

CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
MODEL = '''import queue, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.q = queue.Queue()
        threading.Thread(target=self.loop, daemon=True).start()

    def execute(self, requests):
        for r in requests:
            self.q.put(r.get_response_sender())
        return None

    def loop(self):
        while True:
            sender = self.q.get()
            out = pb_utils.Tensor("text_output", np.array([b"x"], dtype=np.object_))
            for i in range(3):
                time.sleep(0.002)
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == 2 else 0)

    def finalize(self):
        pb_utils.Logger.log_info("echo: finalize")
'''


def run(streams: int, cancel: bool, exit_timeout: int, work: Path) -> dict:
    import tritonclient.grpc as grpcclient

    from vlora.server.launcher import server_environment
    from vlora.server.ports import free_ports
    from vlora.server.triton_dist import TritonDistribution

    dist = TritonDistribution.locate()
    repo = work / "repo"
    (repo / "echo" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "echo" / "config.pbtxt").write_text(CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(MODEL)
    binary, backends = dist.install(work / "tritonserver")
    http, grpc, metrics = free_ports(3)
    log_path = work / f"tritonserver-{'cancel' if cancel else 'close'}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(binary), f"--model-repository={repo}", f"--backend-directory={backends}",
                                 f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
                                 "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
                                 f"--exit-timeout-secs={exit_timeout}", "--allow-gpu-metrics=false"],
                                stdout=log, stderr=subprocess.STDOUT, env=server_environment(dist))
    url = f"127.0.0.1:{grpc}"
    try:
        client = grpcclient.InferenceServerClient(url)
        for _ in range(240):
            try:
                if client.is_model_ready("echo"):
                    break
            except Exception:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({proc.returncode}); see {log_path}")
            time.sleep(0.5)

        def one(_: int) -> None:
            answers: queue.Queue = queue.Queue()
            c = grpcclient.InferenceServerClient(url)
            c.start_stream(callback=lambda result, error: answers.put((result, error)))
            text = grpcclient.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
            c.async_stream_infer("echo", [text], enable_empty_final_response=True)
            for _ in range(2):
                answers.get(timeout=30)
            c.stop_stream(cancel_requests=cancel)
            c.close()

        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(streams)))
        traffic_s = time.monotonic() - t0
        time.sleep(3)
    finally:
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(exit_timeout + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    text = log_path.read_text(errors="replace")
    return {"streams": streams, "cancelled": cancel, "traffic_s": round(traffic_s, 1), "exit_code": code,
            "stop_s": round(time.monotonic() - t1, 1), "finalize_ran": "echo: finalize" in text,
            "live_model_lines": text.count("live models")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=6000)
    ap.add_argument("--exit-timeout", type=int, default=15)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="triton-stream-cancel-") as tmp:
        rows = [run(args.streams, cancel, args.exit_timeout, Path(tmp)) for cancel in (True, False)]
    for r in rows:
        print(f"{r['streams']} streams {'cancelled' if r['cancelled'] else 'closed'} after 2 of 3 responses: "
              f"tritonserver exit {r['exit_code']} in {r['stop_s']} s, finalize() ran: {r['finalize_ran']}")
    result = {"benchmark": "triton-stream-cancel", "device": "cpu", "commit": git_commit(), "rows": rows}
    cancel, close = rows
    summary = (f"Triton 2.51 alone (a 3-response decoupled Python model, no vlora code), {args.streams} gRPC streams each "
               f"stopped after 2 responses: cancelled (stop_stream(cancel_requests=True)) -> exit {cancel['exit_code']} after "
               f"{cancel['stop_s']} s, finalize() ran: {cancel['finalize_ran']}; closed without cancelling -> exit "
               f"{close['exit_code']} after {close['stop_s']} s, finalize() ran: {close['finalize_ran']}")
    write_result("triton-stream-cancel", RESULTS, result, summary, record=not args.no_record)

if __name__ == "__main__":
    main()
