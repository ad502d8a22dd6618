"""TPU tier: serving on the chip (`make test-tpu`; docs/tpu.md). The engine's decode steps go through our ragged Pallas
kernel (the default on a TPU) over a pool padded to 128 lanes; the HTTP server itself listens on a unix socket (the TPU
machine refuses TCP sockets; serve.uds) and the openai client drives it through httpx's UDS transport."""

import concurrent.futures

import httpx
import openai
import pytest

from jaxlm import serve
from jaxlm.model import ragged_paged
from jaxlm.infer import api, generate
from jaxlm.config import DecodeConfig

pytestmark = pytest.mark.tpu

PROMPTS = ["def main():\n    ", "import sys\n", "class Config:\n    def __init__(self", "    return self."]


@pytest.fixture(scope="module")
def served(tpu_quickstart_run, tpu, tmp_path_factory):  # the run first: its CLI process needs the chip free
    run, _ = tpu_quickstart_run
    sock = tmp_path_factory.mktemp("uds") / "jaxlm.sock"
    cfg = serve.settings_config({"serve.uds": str(sock), "serve.max_slots": 16, "serve.model_name": "quickstart"})
    srv = serve.Server(serve.build(run, cfg, log=lambda s: None), uds=cfg.serve.uds).start()
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=120)
    client = openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http, max_retries=0)
    yield srv, client, http
    http.close()
    srv.stop()


def test_the_engine_decodes_through_the_pallas_kernel_on_a_pool_of_128_lanes(served):
    srv, _, _ = served
    engine = srv.served.engine
    assert engine.kv.page_format.lane == 128 and engine.kv.page_format.kernel is not None
    assert isinstance(engine.kv.page_format.kernel, ragged_paged.Kernel), engine.kv.page_format.kernel  # the default
    assert engine.kv.page_size == 128  # serve.page_size's default on a TPU (paged.TPU_PAGE)


def test_openai_client_over_the_unix_socket_gives_greedy_decodings_text(served, tpu_quickstart_run):
    """Greedy completions through the server (paged pool, kernel decode) against `generate` on the chip (dense
    cache, the same weights): equal, or parted at a near tie of the model's logits."""
    from test_tpu_model import assert_same_or_near_tie

    srv, client, http = served
    assert http.get("http://localhost/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["quickstart"]
    model = api.load(tpu_quickstart_run[0])
    want = generate.generate(model.params, model.config.model, [list(p.encode()) for p in PROMPTS],
                             DecodeConfig(max_new_tokens=24, temperature=0.0)).tokens
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: client.completions.create(model="quickstart", prompt=p, max_tokens=24,
                                                                temperature=0), PROMPTS))
    for prompt, answer, ids in zip(PROMPTS, got, want):
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 24
        assert_same_or_near_tie(model, list(prompt.encode()), ids, list(answer.choices[0].text.encode()))


def test_streams_over_the_unix_socket_finish_and_give_their_pages_back(served):
    srv, client, _ = served

    def stream(i):
        chunks = list(client.completions.create(model="quickstart", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=32,
                                                temperature=0.8, seed=i, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 32, chunks[-1]
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(stream, range(12)))
    assert all(texts), texts
    assert len(set(texts)) > 1  # seeded sampling: the streams differ
    assert srv.served.engine.pages_used() == 0
