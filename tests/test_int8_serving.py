"""decode.quantize_weights=int8: a trained model's weights converted once at load (jaxlm.load, `jaxlm generate`,
`jaxlm serve`) generate the float model's greedy text and score a held-out text as it does, within stated bounds,
from about a third of its bytes; the serving engine runs over them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_config
from jaxlm import cli
from jaxlm.train import loop as train
from jaxlm.config import ConfigError, ServeConfig
from jaxlm.infer import api
from jaxlm.model import quant

# Bounds, measured on this model (tiny Shakespeare, 60-100 steps): the mean log-probability of 8 x 32 held-out
# characters moved by 0.0005 nats (-3.0093 float, -3.0088 int8 at 100 steps), the greedy text of 24 tokens unchanged.
LOGPROB_BOUND = 0.01  # nats per token
GREEDY_SAME = 24  # tokens of greedy text equal to the float model's


@pytest.fixture(scope="module")
def run(char_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("int8_serving") / "run"
    cfg = tiny_config(char_data, folder, **{"training.steps": 60, "training.eval_interval": 0,
                                            "checkpoint.interval": 0, "optimizer.lr": 1e-2})
    train.train(cfg, devices=jax.devices()[:1], log=lambda s: None)
    return folder


def mean_logprob(model, ids_BT: np.ndarray) -> float:
    """Mean log-probability of each row's tokens after the first, given the ones before."""
    lp = jax.nn.log_softmax(model.logits(ids_BT[:, :-1]), axis=-1)
    return float(np.mean(np.take_along_axis(np.asarray(lp), ids_BT[:, 1:, None], axis=-1)))


def test_int8_weights_keep_greedy_text_and_log_probabilities_from_a_third_of_the_bytes(run, char_data):
    float_model, int8_model = api.load(run), api.load(run, quantize_weights="int8")
    layers = int8_model.params["layers"]
    assert isinstance(layers["attn"]["q"], quant.QWeight) and isinstance(layers["mlp"]["down"], quant.QWeight)
    assert layers["attn"]["q"].value.dtype == np.int8
    out = int8_model.params.get("lm_head", int8_model.params["embed"]["tokens"])
    assert isinstance(out, quant.QWeight)  # the output projection too
    assert quant.nbytes(int8_model.params) < 0.35 * quant.nbytes(float_model.params)  # float32 stored

    held_out = np.fromfile(char_data / "val.bin", np.uint16)[:8 * 33].astype(np.int32).reshape(8, 33)  # 8 x 32
    f, q = mean_logprob(float_model, held_out), mean_logprob(int8_model, held_out)
    assert f > -3.5, f  # trained: above uniform over 65 characters (-4.17)
    assert 0 < abs(q - f) < LOGPROB_BOUND, (f, q)

    prompt = held_out[0, :8].tolist()
    greedy = [m.generate(prompt, GREEDY_SAME, temperature=0.0, stop_ids=()) for m in (float_model, int8_model)]
    assert greedy[0] == greedy[1] and len(greedy[0]) == GREEDY_SAME

    # the serving engine (paged cache) over the int8 weights gives generate's greedy tokens
    from jaxlm.serve.engine import Engine
    from jaxlm.serve.requests import Sequence

    e = Engine(int8_model.params, int8_model.config.model, ServeConfig(max_slots=2, prefix_cache=0), 32)
    events = e.run([Sequence(prompt, GREEDY_SAME, 0.0, 0, 1.0, 0, 0, (), None)], timeout=300)
    assert [t for ev in events[0] if ev[0] == "tokens" for t in ev[1]] == greedy[1]

    with pytest.raises(ConfigError, match="quantize_weights='int4' is not one of none, int8"):
        api.load(run, quantize_weights="int4")


def test_jaxlm_generate_takes_quantize_weights(run, capsys):
    assert cli.main(["generate", str(run), "--prompt", "ROMEO:", "max_new_tokens=12", "temperature=0",
                     "quantize_weights=int8"]) == 0
    assert "ROMEO:" in capsys.readouterr().out
    assert cli.main(["generate", str(run), "--prompt", "ROMEO:", "quantize_weights=int4"]) == 2
    assert "quantize_weights" in capsys.readouterr().err
