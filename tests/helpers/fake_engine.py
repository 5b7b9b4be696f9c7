"""A loopback serving engine (127.0.0.1) that answers as SGLang and vLLM document their
speculative-decoding metrics (formats and versions: tests/test_server_eval.py), with a
deterministic accept count per prompt; used by the server-mode tests of the evaluator too."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15], [16, 17, 18]]


def fake_rounds(prompt: list[int]) -> tuple[int, int]:
    """(verify steps, accepted drafts) the fake engine reports for a prompt: deterministic."""
    steps = 2 + len(prompt) % 3
    return steps, (sum(prompt) % 7) + steps


class FakeEngine(ThreadingHTTPServer):
    """flavour: sglang | vllm_per_request | vllm_prometheus | vllm_plain answer as documented;
    `raw` (bytes) replaces every answer body verbatim (POST, and GET /metrics); `huge` streams
    an answer of that many bytes (declared in Content-Length when `declare`, else close-delimited)."""

    def __init__(
        self, flavour: str, fail_first: int = 0, raw: bytes | None = None, huge: int = 0, declare: bool = True
    ) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.flavour, self.fail_left = flavour, fail_first
        self.raw, self.huge, self.declare = raw, huge, declare
        self.sent = 0  # bytes of a huge answer written before the client hung up
        self.sending = False
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = self.requests = 0
        self.drafts = self.accepted = 0
        self.gate = threading.Event()  # releases requests only once several are in flight (or after a wait)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeEngine

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: dict | str) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        if getattr(self, "counted", False):  # out of the in-flight count before the client can have the answer:
            self.counted = False  # else its next request may arrive before this thread counts this one down
            with self.server.lock:
                self.server.in_flight -= 1
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_huge(self) -> None:
        s = self.server
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if s.declare:
            self.send_header("Content-Length", str(s.huge))
        self.end_headers()
        chunk = b" " * (1 << 20)
        s.sending = True
        try:
            while s.sent < s.huge:
                self.wfile.write(chunk)
                s.sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            s.sending = False

    def do_GET(self) -> None:
        s = self.server
        if self.path == "/metrics" and s.raw is not None:
            self._send(200, s.raw.decode())
        elif self.path == "/metrics" and s.flavour == "vllm_prometheus":
            text = (
                "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
                "# TYPE vllm:spec_decode_num_drafts_total counter\n"
                f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(s.drafts)}\n'
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {float(s.accepted)}\n'
                'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 999.0\n'
            )
            self._send(200, text)
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if s.huge:
            self._send_huge()
            return
        if s.raw is not None:
            with s.lock:
                s.requests += 1
            self._send(200, s.raw.decode())
            return
        with s.lock:
            s.requests += 1
            if s.fail_left > 0:
                s.fail_left -= 1
                self._send(503, {"error": "warming up"})
                return
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            if s.in_flight >= 2:
                s.gate.set()
        self.counted = True  # _send counts it down just before the answer goes out
        s.gate.wait(timeout=2.0)
        try:
            self._answer(body)
        finally:
            if self.counted:  # _answer failed before sending
                self.counted = False
                with s.lock:
                    s.in_flight -= 1

    def _answer(self, body: dict) -> None:
        s = self.server
        if s.flavour == "sglang":
            assert self.path == "/generate" and body["sampling_params"]["temperature"] == 0
            prompt = body["input_ids"]
            steps, accepted = fake_rounds(prompt)
            completion = steps + accepted
            self._send(
                200,
                {
                    "text": "x",
                    "output_ids": list(range(completion)),
                    "meta_info": {
                        "id": "r",
                        "finish_reason": {"type": "length", "length": completion},
                        "prompt_tokens": len(prompt),
                        "completion_tokens": completion,
                        "cached_tokens": 0,
                        "spec_accept_rate": 0.5,
                        "spec_accept_length": completion / steps,
                        "spec_accept_token_num": accepted,
                        "spec_draft_token_num": steps * 15,
                        "spec_verify_ct": steps,
                    },
                },
            )
            return
        assert self.path == "/v1/completions" and body["temperature"] == 0 and body["model"] == "served"
        prompt = body["prompt"]
        steps, accepted = fake_rounds(prompt)
        answer = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "served",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": body["max_tokens"],
                "total_tokens": len(prompt) + body["max_tokens"],
            },
        }
        with s.lock:
            s.drafts += steps
            s.accepted += accepted
        if s.flavour == "vllm_per_request":
            answer["metrics"] = {
                "time_to_first_token_ms": 1.0,
                "speculative_decoding": {
                    "mean_acceptance_length": 1 + accepted / steps,
                    "draft_acceptance_rate": accepted / (steps * 15),
                    "num_spec_steps": steps,
                    "num_accepted_draft_tokens": accepted,
                    "num_draft_tokens": steps * 15,
                },
            }
        self._send(200, answer)
