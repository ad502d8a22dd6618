"""The Python API for notebooks and scripts: `model = jaxlm.load(PATH)`, then `model.logits(tokens)`,
`model.generate(prompt_ids, ...)` and `model.generate_text(prompt, ...)`, or in one call
`jaxlm.generate(PATH, "def ", temperature=0.7)`. PATH is a run directory (its latest checkpoint) or a folder
written by `jaxlm convert from-hf`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import config as config_lib, runtime, sharding, storage
from jaxlm.store import weights
from jaxlm.infer import generate
from jaxlm.config import Config, ConfigError, DecodeConfig, MeshConfig, ModelConfig
from jaxlm.data import hf_folder, image_kinds, tokenizer as tokenizer_lib
from jaxlm.model import forward, images_as_input


@partial(jax.jit, static_argnames=("cfg", "layout"))
def _logits(params, tokens_BT, cfg: ModelConfig, layout: sharding.Layout | None, images=None):
    with sharding.within(layout):
        return forward(params, tokens_BT, cfg, images=images)


@dataclass
class Model:
    config: Config
    params: dict
    path: Path
    mesh: jax.sharding.Mesh | None = None  # weights, activations and the KV cache sharded over it (None: one device)

    def logits(self, tokens, images=None) -> np.ndarray:
        """int tokens [batch, length] -> float32 logits [batch, length, vocab] (a numpy array). images (a model
        with a vision tower): preprocessed images [n, side, side, 3] (data/images.py; Llama 4: tiles,
        data/images_llama4.py; Qwen-VL: a list of patch grids, data/images_qwen.py) in the order of their image
        tokens, whose soft tokens replace those tokens."""
        tokens_BT = np.asarray(tokens)
        if tokens_BT.ndim != 2 or not np.issubdtype(tokens_BT.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array [batch, length], got {tokens_BT.dtype} "
                             f"{tokens_BT.shape}")
        V = self.config.model.vocab_size
        if tokens_BT.size and (tokens_BT.min() < 0 or tokens_BT.max() >= V):
            raise ValueError(f"token ids must be in [0, {V}), got [{tokens_BT.min()}, {tokens_BT.max()}]")
        images = images_as_input(images, self.config.model, tokens_BT)
        return np.asarray(_logits(self.params, jnp.asarray(tokens_BT, jnp.int32), self.config.model,
                                  sharding.layout(self.mesh), images))

    def generate(self, prompt_ids: list[int], new_tokens: int = 200, temperature: float = 0.8, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_ids: tuple[int, ...] | None = None, images=None) -> list[int]:
        """Sample up to `new_tokens` ids after the prompt with the KV cache (temperature 0 = greedy); stops
        after any of `stop_ids` (by default the model's end-of-sequence ids, as `jaxlm generate` does). images:
        as for `logits`."""
        d = DecodeConfig(max_new_tokens=new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        stop = self.eos_ids() if stop_ids is None else tuple(stop_ids)
        return generate.generate(self.params, self.config.model, [list(prompt_ids)], d, stop,
                                 mesh=self.mesh, images=images).tokens[0]

    def eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: a converted model's, as generation stops at them (data/hf_folder.py:
        generation_config.json, else its hf_config.json's top level, then text_config); none for jaxlm's own
        char/byte vocabularies."""
        tok_dir = weights.tokenizer_source(self.path, self.config)
        return hf_folder.stop_ids(tok_dir) if tok_dir is not None else ()

    def tokenizer(self) -> tokenizer_lib.Tokenizer:
        """The tokenizer of this model, by the precedence of data/tokenizer.py: data.tokenizer if set, else the
        tokenizer files copied from Hugging Face by `jaxlm convert from-hf`, else the run's prepared data
        (meta.json). Its eos_ids include the model's end-of-sequence ids (eos_ids)."""
        explicit = self.config.data.tokenizer
        tok_dir = weights.tokenizer_source(self.path, self.config)
        data = self.config.data
        meta_file = storage.join(data.dir or f"data/{data.dataset}", "meta.json")  # data.dir may be a URL
        meta = (json.loads(storage.read_text(meta_file)) if not explicit and tok_dir is None
                and storage.exists(meta_file) else None)
        if not explicit and tok_dir is None and meta is None:
            raise tokenizer_lib.TokenizerError(f"no tokenizer for {self.path}: no tokenizer/ folder and no "
                                               f"{meta_file} (run from the folder the model was trained in, set "
                                               "data.dir in its config.json, or give --tokenizer)")
        tok = tokenizer_lib.resolve(explicit, tok_dir, meta)
        if tok_dir is not None:
            tok.add_stop_ids(self.eos_ids())
        return tok

    def chat_prompt(self, messages: list[dict]) -> str:
        """The model's chat template applied to `messages` with the generation prompt, as `jaxlm prepare chat`
        renders training conversations."""
        return self.tokenizer().apply_chat_template(messages, add_generation_prompt=True)

    def generate_text(self, prompt: str | list[str] | list[dict], **settings) -> str | list[str]:
        """Text after the prompt (or after each of a list of prompts); `settings` are decode.* keys
        (max_new_tokens, temperature, top_k, top_p, seed, num_samples, stop_tokens, ...). A prompt that is a list
        of {role, content} messages is rendered with the chat template first (chat_prompt)."""
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        if chat:
            prompt = self.chat_prompt(prompt)
        d = decode_config(settings)
        tok = self.tokenizer()
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        ids = [encode_prompt(tok, p, rendered=chat) for p in prompts for _ in range(d.num_samples)]
        stop = config_lib.stop_token_ids(d) + (tok.eos_ids if d.stop_at_eos else ())
        out = generate.generate(self.params, self.config.model, ids, d, stop, mesh=self.mesh)
        texts = [tok.decode(t) for t in out.tokens]
        return texts[0] if isinstance(prompt, str) and d.num_samples == 1 else texts


def encode_prompt(tok: tokenizer_lib.Tokenizer, text: str, rendered: bool = False) -> list[int]:
    """Prompt ids by the same rule as prepared documents: the tokenizer's BOS first when it uses one. A prompt
    the chat template `rendered` keeps its special tokens (the template writes any BOS itself)."""
    if rendered:
        return tok.encode_rendered(text)
    ids = tok.encode(text)
    return [tok.bos_id] + ids if tok.bos_id is not None else ids


def image_prompts(model: Model, tok: tokenizer_lib.Tokenizer, texts: list[str], sources: list, bos: list[int]
                  ) -> tuple[list[list[int]], object]:
    """The token ids of prompts that each hold the images at `sources` (paths or data URLs), written as the model's
    processor writes them, and the images of all prompts in order as `generate` takes them; preprocessed by the
    model folder's image processor settings (data/hf_folder.py; per tower kind: data/image_kinds.py)."""
    v = model.config.model.vision
    kind = image_kinds.of(v)
    processor = kind.processor(weights.tokenizer_source(model.path, model.config), v)
    prepared = image_kinds.prepare_all(sources, v, processor)
    ids = [bos + tok.encode_rendered(kind.expand(text, tok, v, prepared)) for text in texts]
    return ids, kind.batch(prepared * len(ids))


def decode_config(settings: dict) -> DecodeConfig:
    """DecodeConfig from `key=value` settings; keys may omit the `decode.` prefix."""
    overrides = {k if k.startswith("decode.") else f"decode.{k}": v for k, v in settings.items()}
    d = config_lib.apply_overrides(Config(), overrides).decode
    config_lib.validate_decode(d)
    return d


def serving_mesh(mesh_cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """A mesh for inference from mesh.* settings: all devices when an axis is -1 (fill), else the first
    devices that the axes multiply to (`mesh.ici_data=1 mesh.ici_tensor=4`: tensor parallel on 4 devices)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [getattr(mesh_cfg, f"{level}_{a}") for level in ("ici", "dcn") for a in sharding.MESH_AXES]
    if -1 not in sizes:
        n = math.prod(sizes)
        if n > len(devices):
            raise ConfigError(f"the mesh.* axes multiply to {n} devices but {len(devices)} are available")
        devices = devices[:n]
    return sharding.make_mesh(mesh_cfg, devices)


def load(path: str | Path, mesh: jax.sharding.Mesh | MeshConfig | None = None, quantize_weights: str = "none"
         ) -> Model:
    """`mesh` (a Mesh, or mesh.* settings as a MeshConfig) shards the weights by the parameter rules and runs
    logits and generation on it; None keeps everything on one device. quantize_weights="int8"
    (decode.quantize_weights): the matmul weights converted once to int8 per output channel (int8_params)."""
    if not Path(path).exists():
        raise ConfigError(f"{path} does not exist; give a run directory or a `jaxlm convert from-hf` folder")
    if runtime.platform() == "cpu":
        runtime.tune_for_xla_cpu()
    runtime.use_compilation_cache(Config().compile.cache_dir)
    rules = None
    if isinstance(mesh, MeshConfig):
        rules = sharding.rules_from_config(mesh)[0]
        mesh = serving_mesh(mesh)
    if quantize_weights not in ("none", "int8"):
        raise ConfigError(f"quantize_weights={quantize_weights!r} is not one of none, int8")
    if quantize_weights == "none":
        cfg, params = weights.load_params(path, mesh=mesh, rules=rules)
        return Model(cfg, params, Path(path), mesh)
    # read into host memory: the float weights and their int8 copy need not fit on the device side by side
    cfg, params = weights.load_params(path, device=jax.devices("cpu")[0])
    return Model(cfg, int8_params(params, cfg.model, mesh, rules), Path(path), mesh)


def int8_params(params: dict, m: ModelConfig, mesh: jax.sharding.Mesh | None = None, rules=None) -> dict:
    """The weights `decode.quantize_weights=int8` serves (quant.serving_params: every layer's matmul weights and
    the output projection int8 with a float32 scale per output channel), converted where `params` lie and placed
    on `mesh` by the parameter rules (None: the first device): an int8 weight as its float one, its scales
    replicated (a few KiB a layer)."""
    from jaxlm import params as P
    from jaxlm.model import param_specs, quant

    q = jax.jit(quant.serving_params, static_argnums=1)(params, m)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = (P.shardings(param_specs(m), mesh, rules or sharding.PARAM_RULES) if mesh is not None
              else jax.tree.map(lambda _: one, params))

    def place(w, s):
        if isinstance(w, quant.QWeight):
            whole = s if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            return quant.QWeight(jax.device_put(w.value, s), jax.device_put(w.scale, whole))
        return jax.device_put(w, s)

    return jax.tree.map(place, q, target, is_leaf=lambda w: isinstance(w, quant.QWeight))


def generate_text(src: str | Path | Model, prompt: str | list[str], **settings) -> str | list[str]:
    """`jaxlm.generate(PATH_OR_MODEL, prompt, **decode settings)`: the sampled continuation(s) as text."""
    model = src if isinstance(src, Model) else load(src)
    return model.generate_text(prompt, **settings)
