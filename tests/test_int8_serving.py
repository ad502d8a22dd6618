"""decode.quantize_weights=int8: a trained model's weights converted once at load (jaxlm.load, `jaxlm generate`,
`jaxlm serve`) generate the float model's greedy text and score a held-out text as it does, within stated bounds,
from about a third of its bytes; the serving engine runs over them (paged and slot caches)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_config
from jaxlm import cli, train
from jaxlm.config import ConfigError, ServeConfig
from jaxlm.infer import api
from jaxlm.model import quant

# Bounds, measured on this model (60 steps of tiny Shakespeare): the mean log-probability of 256 held-out
# characters moved by 0.0009 nats, the greedy text of 24 tokens unchanged.
LOGPROB_BOUND = 0.01  # nats per token
GREEDY_SAME = 24  # tokens of greedy text equal to the float model's


@pytest.fixture(scope="module")
def run(char_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("int8_serving") / "run"
    cfg = tiny_config(char_data, folder, **{"training.steps": 60, "training.eval_interval": 0,
                                            "checkpoint.interval": 0, "optimizer.lr": 1e-2})
    train.train(cfg, devices=jax.devices()[:1], log=lambda s: None)
    return folder


def mean_logprob(model, ids: np.ndarray) -> float:
    lp = jax.nn.log_softmax(model.logits(ids[None, :-1])[0], axis=-1)
    return float(np.mean(np.take_along_axis(np.asarray(lp), ids[1:, None], axis=-1)))


def test_int8_weights_keep_greedy_text_and_log_probabilities_from_a_third_of_the_bytes(run, char_data):
    float_model, int8_model = api.load(run), api.load(run, quantize_weights="int8")
    layers = int8_model.params["layers"]
    assert isinstance(layers["attn"]["q"], quant.QWeight) and isinstance(layers["mlp"]["down"], quant.QWeight)
    assert layers["attn"]["q"].value.dtype == np.int8
    out = int8_model.params.get("lm_head", int8_model.params["embed"]["tokens"])
    assert isinstance(out, quant.QWeight)  # the output projection too
    assert quant.nbytes(int8_model.params) < 0.35 * quant.nbytes(float_model.params)  # float32 stored

    held_out = np.fromfile(char_data / "val.bin", np.uint16)[:257].astype(np.int32)
    f, q = mean_logprob(float_model, held_out), mean_logprob(int8_model, held_out)
    assert f > -2.5  # trained: far above uniform over 65 characters (-4.17)
    assert 0 < abs(q - f) < LOGPROB_BOUND, (f, q)

    prompt = held_out[:16].tolist()
    greedy = [m.generate(prompt, GREEDY_SAME, temperature=0.0, stop_ids=()) for m in (float_model, int8_model)]
    assert greedy[0] == greedy[1] and len(greedy[0]) == GREEDY_SAME

    # the serving engine over the int8 weights: the paged and the slot cache give generate's greedy tokens
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.requests import Sequence

    for page_size in (-1, 0):
        e = Engine(int8_model.params, int8_model.config.model, ServeConfig(max_slots=2, page_size=page_size,
                                                                           prefix_cache=0), 64)
        events = e.run([Sequence(prompt, GREEDY_SAME, 0.0, 0, 1.0, 0, 0, (), None)], timeout=300)
        assert [t for ev in events[0] if ev[0] == "tokens" for t in ev[1]] == greedy[1], page_size

    with pytest.raises(ConfigError, match="quantize_weights='int4' is not one of none, int8"):
        api.load(run, quantize_weights="int4")


def test_jaxlm_generate_takes_quantize_weights(run, capsys):
    assert cli.main(["generate", str(run), "--prompt", "ROMEO:", "max_new_tokens=12", "temperature=0",
                     "quantize_weights=int8"]) == 0
    assert "ROMEO:" in capsys.readouterr().out
    assert cli.main(["generate", str(run), "--prompt", "ROMEO:", "quantize_weights=int4"]) == 2
    assert "quantize_weights" in capsys.readouterr().err
