"""`eval.mode=server`: tau read from a serving engine, against a loopback HTTP server (127.0.0.1)
that answers in the documented formats of

- SGLang at commit c60799d0 (python/sglang/srt/managers/tokenizer_manager.py,
  `_calculate_spec_decoding_metrics`): POST /generate -> {"text", "output_ids", "meta_info":
  {"completion_tokens", "spec_verify_ct", "spec_accept_length" = completion_tokens / spec_verify_ct}};
- vLLM v0.32.0 (docs features/speculative_decoding/acceptance_metrics and its
  tests/.../test_per_request_spec_decode_metrics): POST /v1/completions -> {"choices", "usage",
  "metrics": {"speculative_decoding": {"mean_acceptance_length", "num_spec_steps",
  "num_accepted_draft_tokens", "num_draft_tokens", "draft_acceptance_rate"}}} when started with
  --per-request-spec-decode-metrics, else no such field and Prometheus counters
  vllm:spec_decode_num_drafts_total / vllm:spec_decode_num_accepted_tokens_total on /metrics.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_dist.evaluator.server import ServerError, ServerResult, server_tau

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15], [16, 17, 18]]
MAX_NEW = 12


def _rounds(prompt: list[int]) -> tuple[int, int]:
    """(verify steps, accepted drafts) the fake engine reports for a prompt: deterministic."""
    steps = 2 + len(prompt) % 3
    return steps, (sum(prompt) % 7) + steps


class FakeEngine(ThreadingHTTPServer):
    def __init__(self, flavour: str, fail_first: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.flavour, self.fail_left = flavour, fail_first
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
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        s = self.server
        if self.path == "/metrics" and s.flavour == "vllm_prometheus":
            text = ("# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
                    "# TYPE vllm:spec_decode_num_drafts_total counter\n"
                    f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(s.drafts)}\n'
                    f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {float(s.accepted)}\n'
                    'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 999.0\n')
            self._send(200, text)
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
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
        s.gate.wait(timeout=2.0)
        try:
            self._answer(body)
        finally:
            with s.lock:
                s.in_flight -= 1

    def _answer(self, body: dict) -> None:
        s = self.server
        if s.flavour == "sglang":
            assert self.path == "/generate" and body["sampling_params"]["temperature"] == 0
            prompt = body["input_ids"]
            steps, accepted = _rounds(prompt)
            completion = steps + accepted
            self._send(200, {"text": "x", "output_ids": list(range(completion)), "meta_info": {
                "id": "r", "finish_reason": {"type": "length", "length": completion}, "prompt_tokens": len(prompt),
                "completion_tokens": completion, "cached_tokens": 0, "spec_accept_rate": 0.5,
                "spec_accept_length": completion / steps, "spec_accept_token_num": accepted,
                "spec_draft_token_num": steps * 15, "spec_verify_ct": steps}})
            return
        assert self.path == "/v1/completions" and body["temperature"] == 0 and body["model"] == "served"
        prompt = body["prompt"]
        steps, accepted = _rounds(prompt)
        answer = {"id": "cmpl-1", "object": "text_completion", "model": "served",
                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                            "total_tokens": len(prompt) + body["max_tokens"]}}
        with s.lock:
            s.drafts += steps
            s.accepted += accepted
        if s.flavour == "vllm_per_request":
            answer["metrics"] = {"time_to_first_token_ms": 1.0, "speculative_decoding": {
                "mean_acceptance_length": 1 + accepted / steps, "draft_acceptance_rate": accepted / (steps * 15),
                "num_spec_steps": steps, "num_accepted_draft_tokens": accepted, "num_draft_tokens": steps * 15}}
        self._send(200, answer)


@pytest.fixture
def engine(request):
    flavour, fail_first = request.param
    srv = FakeEngine(flavour, fail_first)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _per_prompt_mean(per_request) -> float:
    values = [per_request(*_rounds(p)) for p in PROMPTS]
    return sum(values) / len(values)


@pytest.mark.parametrize("engine", [("sglang", 2)], indirect=True)
def test_sglang_meta_info_with_retries_and_bounded_concurrency(engine):
    res = server_tau(engine.url, "sglang", PROMPTS, MAX_NEW, concurrency=3, max_retries=3, timeout_s=10)
    assert res.source == "per_request" and res.requests == len(PROMPTS)
    assert res.tau == pytest.approx(_per_prompt_mean(lambda steps, acc: (steps + acc) / steps))
    assert engine.requests == len(PROMPTS) + 2  # two 503s retried
    assert 2 <= engine.max_in_flight <= 3
    assert ServerResult.from_json(json.loads(json.dumps(res.to_json()))) == res


@pytest.mark.parametrize("engine", [("vllm_per_request", 0)], indirect=True)
def test_vllm_per_request_metrics(engine):
    res = server_tau(engine.url + "/v1", "vllm", PROMPTS, MAX_NEW, model="served", concurrency=2, timeout_s=10)
    assert res.source == "per_request"
    assert res.tau == pytest.approx(_per_prompt_mean(lambda steps, acc: 1 + acc / steps))
    assert engine.max_in_flight <= 2


@pytest.mark.parametrize("engine", [("vllm_prometheus", 1)], indirect=True)
def test_vllm_prometheus_counter_deltas(engine):
    engine.drafts, engine.accepted = 100, 250  # earlier traffic: only the deltas count
    res = server_tau(engine.url, "vllm", PROMPTS, MAX_NEW, model="served", concurrency=4, timeout_s=10)
    steps = sum(_rounds(p)[0] for p in PROMPTS)
    accepted = sum(_rounds(p)[1] for p in PROMPTS)
    assert res.source == "prometheus" and res.per_prompt == ()
    assert res.tau == pytest.approx(1 + accepted / steps)


@pytest.mark.parametrize("engine", [("sglang", 10)], indirect=True)
def test_a_failing_server_is_an_error_naming_it(engine):
    with pytest.raises(ServerError, match=r"/generate: HTTP 503"):
        server_tau(engine.url, "sglang", PROMPTS[:1], MAX_NEW, max_retries=1, timeout_s=5)
    assert engine.requests == 2


@pytest.mark.parametrize("engine", [("vllm_plain", 0)], indirect=True)
def test_a_vllm_server_without_spec_metrics_is_refused_naming_the_flag(engine):
    with pytest.raises(ServerError, match="--per-request-spec-decode-metrics"):
        server_tau(engine.url, "vllm", PROMPTS[:2], MAX_NEW, model="served", max_retries=0, timeout_s=5)


def test_eval_mode_settings_are_checked_at_load():
    from dflash_dist.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.server_url is required"):
        load_config("configs/tiny.yaml", ["eval.mode=server"])
    with pytest.raises(ConfigError, match="eval.server_url .* must start with http"):
        load_config("configs/tiny.yaml", ["eval.mode=server", "eval.server_url=127.0.0.1:30000"])
    with pytest.raises(ConfigError, match="eval.mode: 'fast' is not one of"):
        load_config("configs/tiny.yaml", ["eval.mode=fast"])
    with pytest.raises(ConfigError, match="eval.live_every must be >= 1"):
        load_config("configs/tiny.yaml", ["eval.live_every=0"])
    with pytest.raises(ConfigError, match="eval.count: 'all' is not one of"):
        load_config("configs/tiny.yaml", ["eval.count=all"])
    with pytest.raises(ConfigError, match="eval.reference_drafter: .*config.json not found"):
        load_config("configs/tiny.yaml", ["eval.reference_drafter=/nonexistent"])
    cfg = load_config("configs/tiny.yaml", ["eval.mode=server", "eval.server_url=http://127.0.0.1:8000",
                                            "eval.server_engine=vllm"])
    assert cfg.eval.mode == "server" and cfg.eval.count == "capped" and cfg.eval.live_every == 1
