"""A traced program depends only on its arguments (issue 42): each public program here runs, in one process, under
one setting and then another, and the second result is the second setting's. The settings are those that model
code once read while it was traced, which jax.jit's caches do not see: the mesh and rules of an
`activation_sharding` block opened around a call (a model's logits, `generate`, the serving engine), the paged
pool's format (lanes, page-attention kernel) once taken from the host's backend, a call's stream of tokens once
taken from a process-wide stack; and speculative decoding's executables, once kept without bound or shardings."""

import threading
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np

from jaxlm import params as P, sharding
from jaxlm.infer import api, generate, speculative
from jaxlm.infer.sampling import RowSampling
from jaxlm.config import Config, DecodeConfig, MeshConfig, ModelConfig
from jaxlm.model import forward, paged, param_specs

CFG = ModelConfig(vocab_size=50, block_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, init_std=0.3)


def on(devices, cfg=CFG, seed=0):
    """A mesh over `devices` (data parallel) and the model's weights placed on it."""
    mesh = sharding.make_mesh(MeshConfig(), devices)
    return mesh, P.init(param_specs(cfg), jax.random.key(seed), mesh)


def test_logits_on_one_mesh_then_another():
    """A model on devices 0-3, then the same weights on devices 4-7: each gives the logits of one device. Before,
    the second traced nothing: jax.jit reused the program traced inside the first mesh's block (the block was
    opened around the call), whose sharding constraints name devices 0-3, and the call failed ("Received
    incompatible devices for jitted computation")."""
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 16)).astype(np.int32)
    want = np.asarray(forward(on(jax.devices()[:1])[1], tokens, CFG))
    for devices in (jax.devices()[:4], jax.devices()[4:]):
        mesh, params = on(devices)
        model = api.Model(Config(model=CFG), params, Path("."), mesh)
        np.testing.assert_allclose(model.logits(tokens), want, rtol=0, atol=1e-5)


def test_generate_on_one_mesh_then_another():
    """As test_logits_on_one_mesh_then_another, for generate: the tokens of one device on either mesh. Before, its
    executables were keyed by the mesh but lowered from the jit's trace of the first mesh's block."""
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    d = DecodeConfig(max_new_tokens=8, temperature=0.0)
    want = generate.generate(on(jax.devices()[:1])[1], CFG, prompts, d).tokens
    for devices in (jax.devices()[:4], jax.devices()[4:]):
        mesh, params = on(devices)
        assert generate.generate(params, CFG, prompts, d, mesh=mesh).tokens == want


def test_the_engine_on_one_mesh_then_another():
    """The serving engine on devices 0-1, then on devices 2-3: each serves a request the tokens of generate on one
    device. Before, the second engine's calls ran programs traced in the first engine's mesh (its block opened
    around every call) and the request ended in an error."""
    from jaxlm.config import ServeConfig
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.requests import Sequence

    _, one = on(jax.devices()[:1])
    prompt = [3, 1, 4, 1, 5]
    want = generate.generate(one, CFG, [prompt], DecodeConfig(max_new_tokens=6, temperature=0.0)).tokens[0]
    for devices in (jax.devices()[0:2], jax.devices()[2:4]):
        mesh, params = on(devices)
        e = Engine(params, CFG, ServeConfig(max_slots=2, max_queue=2, prefill_chunk=16, prefix_cache=0,
                                            decode_steps=2, page_size=4), 32, mesh=mesh)
        events, = e.run([Sequence(prompt, 6, 0.0, 0, 1.0, 0, 0, (), None)], timeout=300)
        assert events[-1] == ("done", "length")
        assert [t for ev in events if ev[0] == "tokens" for t in ev[1]] == want


def test_paged_programs_compiled_for_a_tpu_from_this_host_take_the_tpus_pool_format():
    """The engine's paged decode program compiled ahead of time for a TPU v5e from this CPU host: the pool of
    paged.pool_format for the TPU mesh has 128 lanes (heads of 8 packed and padded) and the decode steps run the Pallas
    kernel; then without the kernel (a test's format), then for this host's CPU (no padding, no kernel), each in
    the same process. Before, the pool's padding came from the host's backend while the program was traced (the
    TPU's pool had 8 lanes) and the kernel from a module setting, so the TPU program had no kernel and a program
    traced with one setting was reused under another."""
    from jaxlm.model import ragged_paged
    from jaxlm.train import aot
    from jaxlm.serve import programs

    tpu = sharding.make_mesh(MeshConfig(), aot.tpu_topology("v5e:1x1", 1))
    cpu = sharding.make_mesh(MeshConfig(), jax.devices()[:1])
    tpu_format = paged.pool_format(tpu.devices.flat[0].platform)  # serve.attention_kernel's default: ours
    assert tpu_format == paged.PoolFormat(128, ragged_paged.Kernel(), paged.TPU_PAGE)
    b, M, NP, A = 4, 4, 32, 16
    # keys and values of 8 lanes each: one packed entry "kv" in the kernel's pool (its default), apart in the others
    for mesh, fmt, lanes, kernel, entry in ((tpu, tpu_format, 128, True, "kv"),
                                            (tpu, tpu_format._replace(kernel=None), 128, False, "k"),
                                            (cpu, paged.pool_format(cpu.devices.flat[0].platform), 8, False, "k")):
        layout = sharding.layout(mesh)
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def placed(tree):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)

        pool = placed(jax.eval_shape(partial(programs.empty_pages, CFG, NP, A, False, fmt, layout)))
        assert pool.kinds[0][entry].shape == (2, 2, NP, A, lanes) and pool.kernel is fmt.kernel
        i32 = lambda *shape: placed(jax.ShapeDtypeStruct(shape, np.int32))  # noqa: E731
        f32 = lambda *shape: placed(jax.ShapeDtypeStruct(shape, np.float32))  # noqa: E731
        params = placed(P.abstract(param_specs(CFG)))
        compiled = programs.paged_decode_loop.lower(
            params, None, pool, f32(b, CFG.vocab_size), i32(b), i32(b), i32(), placed(jax.ShapeDtypeStruct((b,), bool)),
            i32(b), i32(b, 4), RowSampling(i32(b), i32(b, M), placed(jax.ShapeDtypeStruct((b,), bool)),
                                           placed(jax.ShapeDtypeStruct((b,), np.uint32)), i32(b), i32(b), f32(b),
                                           i32(b), f32(b)),
            cfg=CFG, max_steps=2, layout=layout).compile()
        assert ("pallas_call" in compiled.as_text()) == kernel


def two_at_once(first, second):
    """Run first(started) in a thread and second() in another once `started` is set (the first call is streaming
    its tokens); returns both results."""
    started, out = threading.Event(), {}

    def run(name, fn, *args):
        try:
            out[name] = fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[name] = e

    threads = [threading.Thread(target=run, args=("first", first, started)),
               threading.Thread(target=lambda: started.wait(120) and run("second", second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for name in ("first", "second"):
        if isinstance(out.get(name), Exception):
            raise out[name]
    return out["first"], out["second"]


def streamed_rows(steps: list, rows: int) -> list[list[int]]:
    """Each row's tokens from on_tokens(tokens, live) calls."""
    return [[int(tok[b]) for tok, live in steps if live[b]] for b in range(rows)]


def two_streaming_calls(decode, settings: dict, own: tuple[dict, dict], sleep: float) -> None:
    """`decode(params, cfg, prompts, d, on_tokens=...)` called twice at once (different weights on two devices,
    on_tokens slowed by `sleep` so that they overlap): each call's on_tokens gets exactly its own tokens."""
    one = on(jax.devices()[:1])[1]
    other = jax.device_put(on(jax.devices()[:1], seed=1)[1], jax.devices()[1])
    calls = [(one, [[1, 2, 3], [4, 5]], DecodeConfig(max_new_tokens=40, **settings, **own[0])),
             (other, [[9], [8, 7], [6, 5, 4]], DecodeConfig(max_new_tokens=12, **settings, **own[1]))]
    for params, prompts, d in calls:  # compiled before, so that the calls overlap
        decode(params, CFG, prompts, d, on_tokens=lambda tok, live: None)
    streams = [[], []]

    def call(i, started=None):
        params, prompts, d = calls[i]

        def on_tokens(tok, live):
            streams[i].append((tok, live))
            if started is not None:
                started.set()
            time.sleep(sleep)

        return decode(params, CFG, prompts, d, on_tokens=on_tokens).tokens

    first, second = two_at_once(partial(call, 0), partial(call, 1))
    assert max(map(len, first)) == 40 and len(second) == 3
    assert streamed_rows(streams[0], 2) == first
    assert streamed_rows(streams[1], 3) == second


def test_two_generate_calls_at_once_each_stream_their_own_tokens():
    """Two generate calls in two threads at once (different prompts, batch sizes, seeds and devices; the first
    slowed by its callback so that they overlap): each call's on_tokens gets exactly its own tokens. Before, the
    loop's callback went to the newest call's (a process-wide stack), so the second call received the first's."""
    two_streaming_calls(generate.generate, dict(temperature=1.0), (dict(seed=3), dict(seed=4)), sleep=0.02)


def test_two_speculative_calls_at_once_each_stream_their_own_tokens():
    """As test_two_generate_calls_at_once_each_stream_their_own_tokens, for speculative decoding (the model drafts
    for itself: every proposal kept)."""
    two_streaming_calls(lambda params, cfg, *a, **kw: speculative.generate_speculative(params, cfg, params, cfg, *a,
                                                                                       **kw),
                        dict(temperature=0.0, draft_tokens=3), ({}, {}), sleep=0.01)


def test_speculative_executables_are_bounded_and_keyed_by_sharding(monkeypatch):
    """The same call with the weights on device 0, then on device 1, then another batch size, with room for two
    executables: the second call runs its own program (the tokens of the first), and the third drops the oldest.
    Before, the key left out shardings (the second call ran the first's executable on device 1's arguments and
    failed) and the dict grew without bound."""
    monkeypatch.setattr(speculative, "_EXECUTABLES", {})
    monkeypatch.setattr(generate, "MAX_EXECUTABLES", 2, raising=False)
    params = on(jax.devices()[:1])[1]
    d = DecodeConfig(max_new_tokens=8, temperature=0.0, draft_tokens=2)
    prompts = [[1, 2, 3], [4, 5]]
    want = speculative.generate_speculative(params, CFG, params, CFG, prompts, d).tokens
    moved = jax.device_put(params, jax.devices()[1])
    assert speculative.generate_speculative(moved, CFG, moved, CFG, prompts, d).tokens == want
    assert len(speculative._EXECUTABLES) == 2
    speculative.generate_speculative(params, CFG, params, CFG, prompts + [[6]], d)
    assert len(speculative._EXECUTABLES) == 2
