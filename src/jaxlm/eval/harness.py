"""Downstream evaluation: lm-evaluation-harness tasks run against a model through `jaxlm serve`'s completions API.
`server_lm` is an lm-eval model over a jaxlm server (ServerClient's requests): log-likelihoods from `echo` +
`logprobs` completions on token-id prompts (tokens named by id, so the greedy check compares ids), generation from
plain completions with the task's stop strings, tokens from the server's /tokenize (the model's own tokenizer,
whatever it is). A document's first token is scored after the token that starts documents in training (BOS, else
EOS); a model with neither cannot score one. `jaxlm eval SRC --tasks ...` starts a server for SRC on 127.0.0.1 in
this process (or uses --url), runs the tasks from lm-eval's registry and `--include-path` folders of task YAML
files, and prints lm-eval's table; nothing is downloaded (docs/serve.md, "Downstream evaluation").
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx

from jaxlm import config as config_lib
from jaxlm.config import ConfigError

BATCH = 16  # prompts per completions request


def _lm_base():
    try:
        from lm_eval.api.model import LM
    except ImportError:
        raise ConfigError("`jaxlm eval --tasks` needs lm-evaluation-harness: pip install 'jaxlm[eval]'") from None
    return LM


class ServerClient:
    """lm-eval's LM methods (loglikelihood, loglikelihood_rolling, generate_until) answered by the jaxlm server at
    base_url (e.g. http://127.0.0.1:8000); server_lm makes an lm-eval LM of it."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        info = self._get("/v1/models")["data"][0]
        self.model, self.max_length = model or info["id"], info["max_model_len"]
        bos, eos = info.get("bos_token_id"), info.get("eos_token_id")
        self.prefix_token_id = bos if bos is not None else eos

    def _get(self, path):
        r = self.http.get(path)
        return self._check(r)

    def _post(self, path, body):
        return self._check(self.http.post(path, json=body))

    @staticmethod
    def _check(r):
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200]
            raise ConfigError(f"the jaxlm server answered {r.status_code}: {message}")
        return r.json()

    def tok_encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text})["tokens"] if text else []

    def _prefix(self, what: str) -> int:
        if self.prefix_token_id is None:
            raise ConfigError(f"{what} needs a token that starts documents (BOS or EOS) to score a first token "
                              "after, and this model's tokenizer has neither")
        return self.prefix_token_id

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether each continuation token is the most likely one
        (compared by id)."""
        out = []
        for i in range(0, len(pairs), BATCH):
            chunk = pairs[i:i + BATCH]
            prompts = []
            for ctx, cont in chunk:
                ids = (ctx + cont)[-self.max_length:]
                if len(ids) <= len(cont):
                    raise ConfigError(f"a context + continuation of {len(ctx) + len(cont)} tokens leaves no "
                                      f"context in the model's {self.max_length} positions")
                prompts.append(ids)
            body = {"model": self.model, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1,
                    "temperature": 0, "return_tokens_as_token_ids": True}
            for (ctx, cont), choice in zip(chunk, self._post("/v1/completions", body)["choices"]):
                lp = choice["logprobs"]
                n = len(cont)
                tokens, token_lp, top = lp["tokens"][-n:], lp["token_logprobs"][-n:], lp["top_logprobs"][-n:]
                greedy = all(max(t, key=t.get) == tok for t, tok in zip(top, tokens))
                out.append((float(sum(token_lp)), greedy))
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = []
        for req in requests:
            context, continuation = req.args
            ctx = self.tok_encode(context) if context else [self._prefix("a log-likelihood with an empty context")]
            pairs.append((ctx, self.tok_encode(continuation)))
        return self._score(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Each document's log-likelihood, every token scored: lm-eval's rolling windows (the first after the
        prefix token, each later one after the tokens before it), of max_length - 1 inputs so that a
        window's inputs and its last target fit in the server's max_length positions."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        prefix = self._prefix("loglikelihood_rolling (perplexity)")
        out = []
        for req in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(req.args[0]), prefix, self.max_length - 1, 1)]
            out.append(sum(lp for lp, _ in self._score(windows)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.tok_encode(context)[-(self.max_length - 1):]
            max_tokens = min(int(kwargs.pop("max_gen_toks", 256)), self.max_length - len(ids))
            sample = kwargs.pop("do_sample", False)
            body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens,
                    "temperature": float(kwargs.pop("temperature", 1.0)) if sample else 0.0,
                    "stop": [u for u in until if u][:4] or None}
            text = self._post("/v1/completions", body)["choices"][0]["text"]
            for u in until[4:]:  # the API takes 4 stop strings; cut at any others here
                if u and u in text:
                    text = text[:text.index(u)]
            out.append(text)
        return out


def server_lm(base_url: str, model: str | None = None, api_key: str | None = None, timeout_s: float = 600.0):
    """An lm-eval LM over the jaxlm server at base_url (e.g. http://127.0.0.1:8000)."""
    LM = _lm_base()

    class ServerLM(ServerClient, LM):
        def __init__(self):
            LM.__init__(self)
            ServerClient.__init__(self, base_url, model, api_key, timeout_s)

    return ServerLM()


def run_tasks(lm, tasks: list[str], include_path: str | None = None, limit: float | None = None,
              num_fewshot: int | None = None) -> dict:
    """lm-eval's results dict for these tasks."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local task data only: nothing can be downloaded
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path} is not a folder of task YAML files")
    # lm-eval's own registry (thousands of YAML files, 20 s to index here) only when the folder lacks a task.
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(unknown)}; give task YAML files with --include-path")
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)


def main(argv: list[str]) -> int:
    """`jaxlm eval SRC --tasks a,b [--include-path DIR] [--limit N] [--url URL] [--output FILE] [key=value]`."""
    p = argparse.ArgumentParser(prog="jaxlm eval", description="Run lm-evaluation-harness tasks against a model "
                                "through jaxlm's OpenAI-compatible server (started here on 127.0.0.1, or --url).")
    p.add_argument("src", nargs="?", help="run directory or converted checkpoint (not needed with --url)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", help="folder of task YAML files (with local data)")
    p.add_argument("--limit", type=float, help="documents per task (a fraction when < 1)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--url", help="evaluate a running `jaxlm serve` at this URL instead of starting one")
    p.add_argument("--api-key", help="the server's API key (default: JAXLM_API_KEY)")
    p.add_argument("--output", help="write lm-eval's results as JSON to this file")
    p.add_argument("settings", nargs="*", metavar="key=value", help="serve.*, decode.*, mesh.* for the server")
    a, rest = p.parse_known_args(argv)
    a.settings += rest
    tasks = [t for t in a.tasks.split(",") if t]
    api_key = a.api_key or os.environ.get("JAXLM_API_KEY")
    server = None
    if a.url:
        url = a.url
    else:
        if not a.src:
            p.error("give the model folder, or --url of a running server")
        from jaxlm import serve

        cfg = serve.settings_config(config_lib.parse_overrides(a.settings))
        server = serve.Server(serve.build(a.src, cfg), "127.0.0.1", 0).start()
        url, api_key = f"http://127.0.0.1:{server.port}", server.served.api_key
    try:
        results = run_tasks(server_lm(url, api_key=api_key), tasks, a.include_path, a.limit, a.num_fewshot)
    finally:
        if server is not None:
            server.stop()
    from lm_eval.utils import make_table

    print(make_table(results))
    if a.output:
        Path(a.output).write_text(json.dumps({"results": results["results"], "versions": results.get("versions")},
                                             indent=2, default=str))
    return 0
