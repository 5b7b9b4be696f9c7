"""tau as the serving engine counts it: the held-out prompts sent to an SGLang or vLLM endpoint
that serves the exported drafter, and the engine's own accept length read back.

Formats followed (the test's loopback server answers in exactly these):
- SGLang (python/sglang/srt/managers/tokenizer_manager.py, `_calculate_spec_decoding_metrics`, at
  commit c60799d0): POST /generate {"input_ids", "sampling_params"} answers
  {"text", "output_ids", "meta_info": {"completion_tokens", "spec_verify_ct", "spec_accept_length",
  ...}} with spec_accept_length = completion_tokens / spec_verify_ct (bonus token included).
- vLLM (docs v0.32.0, features/speculative_decoding/acceptance_metrics): started with
  `--per-request-spec-decode-metrics summary|detailed`, POST /v1/completions answers a top-level
  {"metrics": {"speculative_decoding": {"mean_acceptance_length", "num_spec_steps",
  "num_accepted_draft_tokens", "num_draft_tokens", ...}}}, mean_acceptance_length =
  1 + num_accepted_draft_tokens / num_spec_steps. Without that flag the response has no such
  field and tau comes from the deltas of the Prometheus counters on /metrics,
  `vllm:spec_decode_num_drafts` and `vllm:spec_decode_num_accepted_tokens` (exposed with the
  `_total` suffix): 1 + accepted / drafts over all the requests (a token-weighted mean, not the
  per-prompt mean; the record says which).

Requests go out greedy (temperature 0), `eval.server_concurrency` at a time, each retried on a
5xx, 429, timeout or lost connection with exponential backoff. Plain urllib: no client library.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENGINES = ("sglang", "vllm")
_RETRY_STATUS = {429, 500, 502, 503, 504}
_COUNTER_RE = re.compile(r"^(vllm:spec_decode_num_(?:drafts|accepted_tokens))(?:_total)?(?:\{[^}]*\})?\s+(\S+)$")


class ServerError(RuntimeError):
    """The endpoint failed or answered without the fields this engine's format promises."""


@dataclass(frozen=True)
class ServerResult:
    """The engine's tau over the prompts: `tau` = mean over prompts of each request's accept
    length (source "per_request"), or 1 + accepted/drafts from the counters (source "prometheus")."""

    engine: str
    tau: float
    per_prompt: tuple[float, ...]
    source: str
    requests: int

    def to_json(self) -> dict:
        return {"engine": self.engine, "tau": self.tau, "per_prompt": list(self.per_prompt), "source": self.source,
                "requests": self.requests}

    @classmethod
    def from_json(cls, d: dict) -> ServerResult:
        return cls(str(d["engine"]), float(d["tau"]), tuple(float(x) for x in d["per_prompt"]), str(d["source"]),
                   int(d["requests"]))


def _request(url: str, body: dict | None, timeout_s: float, max_retries: int) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    for attempt in range(max_retries + 1):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers),
                                        timeout=timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code not in _RETRY_STATUS or attempt == max_retries:
                raise ServerError(f"{url}: HTTP {e.code}: {e.read()[:300]!r}") from None
            reason = f"HTTP {e.code}"
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            if attempt == max_retries:
                raise ServerError(f"{url}: {e} (after {max_retries + 1} attempts)") from None
            reason = str(e)
        delay = min(0.25 * 2**attempt, 8.0)
        log.warning("server eval: %s failed (%s), retry %d/%d in %.2fs", url, reason, attempt + 1, max_retries, delay)
        time.sleep(delay)
    raise AssertionError("unreachable")


def _sglang_accept_length(url: str, prompt: list[int], max_new_tokens: int, timeout_s: float, retries: int) -> float:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    out = json.loads(_request(f"{url}/generate", body, timeout_s, retries))
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict) or meta.get("spec_accept_length") is None:
        raise ServerError(f"{url}/generate: no meta_info.spec_accept_length in the answer (is the server started "
                          f"with --speculative-algorithm DFLASH?): {str(out)[:300]}")
    return float(meta["spec_accept_length"])


def _vllm_accept_length(url: str, model: str | None, prompt: list[int], max_new_tokens: int, timeout_s: float,
                        retries: int) -> float | None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0}
    out = json.loads(_request(f"{url}/v1/completions", body, timeout_s, retries))
    if not isinstance(out, dict) or "choices" not in out:
        raise ServerError(f"{url}/v1/completions: not a completion: {str(out)[:300]}")
    spec = (out.get("metrics") or {}).get("speculative_decoding")
    return None if spec is None else float(spec["mean_acceptance_length"])


def vllm_counters(url: str, timeout_s: float = 30.0, retries: int = 3) -> dict[str, float]:
    """The two spec-decode counters from vLLM's Prometheus text, summed over label sets."""
    text = _request(f"{url}/metrics", None, timeout_s, retries).decode()
    counters = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}
    seen = set()
    for line in text.splitlines():
        m = _COUNTER_RE.match(line.strip())
        if m:
            counters[m.group(1)] += float(m.group(2))
            seen.add(m.group(1))
    if len(seen) < 2:
        raise ServerError(f"{url}/metrics has no vllm:spec_decode_num_drafts/num_accepted_tokens counters "
                          "(is speculative decoding on?)")
    return counters


def server_tau(url: str, engine: str, prompts: list[list[int]], max_new_tokens: int, model: str | None = None,
               concurrency: int = 4, max_retries: int = 3, timeout_s: float = 300.0) -> ServerResult:
    """Send every prompt (token ids) greedily to the engine at `url`; its tau (module docstring)."""
    if engine not in ENGINES:
        raise ValueError(f"eval.server_engine must be one of {ENGINES}, got {engine!r}")
    url = url.rstrip("/").removesuffix("/v1")
    before = None
    if engine == "sglang":
        def one(p: list[int]) -> float | None:
            return _sglang_accept_length(url, p, max_new_tokens, timeout_s, max_retries)
    else:
        def one(p: list[int]) -> float | None:
            return _vllm_accept_length(url, model, p, max_new_tokens, timeout_s, max_retries)
        try:
            before = vllm_counters(url, timeout_s, max_retries)
        except ServerError:
            before = None  # no counters: the per-request metrics must be there
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="server-eval") as pool:
        lengths = list(pool.map(one, prompts))
    if all(x is not None for x in lengths):
        per_prompt = tuple(float(x) for x in lengths)
        return ServerResult(engine, sum(per_prompt) / len(per_prompt), per_prompt, "per_request", len(prompts))
    if before is None:
        raise ServerError(f"{url}: vLLM answered without metrics.speculative_decoding and its /metrics has no "
                          "spec-decode counters: start it with --per-request-spec-decode-metrics summary")
    after = vllm_counters(url, timeout_s, max_retries)
    drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
    if drafts <= 0:
        raise ServerError(f"{url}/metrics: vllm:spec_decode_num_drafts did not grow over {len(prompts)} requests")
    return ServerResult(engine, 1.0 + accepted / drafts, (), "prometheus", len(prompts))
