"""Checks that need no data or devices: check_fields reads the range rules on every field, the rest relate
several settings (a head count that must divide the width, a warmup that must fit the run), section by section."""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path

from jaxlm.config.model_schema import ATTENTION_KINDS, ModelConfig
from jaxlm.config.rules import ConfigError
from jaxlm.config.schema import (LORA_TARGETS, MESH_AXES, PREFERENCE_OBJECTIVES, CompileConfig, Config,
                                 DecodeConfig, DistributedConfig, MeshConfig, OptimizerConfig, ServeConfig,
                                 TrainingConfig, spelled)


def check_fields(section, prefix: str = "") -> None:
    """Every field of `section` (a Config or one of its sections, whose keys start with `prefix`) and of the
    sections in it: a float finite (NaN passes a `v <= 0` test and infinity most; no setting means either), a
    value its field's rule allows."""
    for f in dataclasses.fields(section):
        v = getattr(section, f.name)
        key = spelled(prefix + f.name)
        if dataclasses.is_dataclass(v):
            check_fields(v, f"{key}.")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}={v} must be a finite number")
        elif v is not None and "rule" in f.metadata and not f.metadata["rule"].allows(v):
            raise ConfigError(f"{key}={v} must be {f.metadata['rule'].says}")


def _divisors(n: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, ds[:12])) + (", ..." if len(ds) > 12 else "")


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """data.mixture's 'path:weight,path:weight' -> [(path, weight)]; weights > 0 (they need not sum to 1)."""
    out = []
    for part in spec.split(","):
        path, _, weight = part.strip().rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = float("nan")
        if not path or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"data.mixture={spec!r}: {part.strip()!r} is not PATH:WEIGHT with a weight > 0; "
                              "write e.g. data.mixture=data/web:0.7,data/code:0.3")
        out.append((path, w))
    return out


def validate(cfg: Config) -> None:
    """The ranges on the fields, then the checks that relate several settings, section by section."""
    if cfg.data.mixture is not None:
        parse_mixture(cfg.data.mixture)
    check_fields(cfg)
    if cfg.run_dir == "":
        raise ConfigError("run_dir='' is empty; give a folder, or None for outputs/<timestamp>")
    _validate_model(cfg.model, cfg.mesh)
    _validate_optimizer_and_training(cfg.optimizer, cfg.training)
    if cfg.optimizer.qk_clip and cfg.model.qk_l2_norm:
        raise ConfigError(f"optimizer.qk_clip={cfg.optimizer.qk_clip} scales query and key weights, whose scale "
                          "model.qk_l2_norm normalizes away (it bounds the logits itself); set optimizer.qk_clip=0")
    _validate_lora(cfg)
    _validate_preference(cfg)
    _validate_grpo(cfg)
    _validate_mesh_and_distributed(cfg.mesh, cfg.distributed)
    _validate_diagnostics(cfg)
    validate_decode(cfg.decode)
    validate_serve(cfg.serve)
    validate_compile(cfg.compile)


def _validate_model(m: ModelConfig, mesh: MeshConfig) -> None:
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} "
                          f"(allowed: {_divisors(m.d_model)}), or set model.head_dim")
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.kv_heads} must divide model.n_heads={m.n_heads} "
                          f"(allowed: {_divisors(m.n_heads)})")
    if m.position == "rotary" and m.hd % 2:
        raise ConfigError(f"rotary embeddings need an even head width, got {m.hd} (model.d_model / model.n_heads)")
    bad = [k for k in m.pattern if k not in ATTENTION_KINDS]
    if bad:
        raise ConfigError(f"model.layer_pattern={m.layer_pattern!r} has {bad[0]!r}; allowed kinds: "
                          f"{', '.join(ATTENTION_KINDS)} (comma-separated, e.g. local,global)")
    if len(m.pattern) > m.n_layers:
        raise ConfigError(f"model.layer_pattern={m.layer_pattern!r} has {len(m.pattern)} kinds, more than "
                          f"model.n_layers={m.n_layers}")
    if "local" in m.pattern and m.sliding_window is None:
        raise ConfigError(f"model.layer_pattern={m.layer_pattern!r} has local layers; set model.sliding_window")
    if "chunked" in m.pattern and m.attention_chunk is None:
        raise ConfigError(f"model.layer_pattern={m.layer_pattern!r} has chunked layers; set model.attention_chunk")
    m.megablox_tiles  # noqa: B018 - raises ConfigError on a malformed model.moe_tiles
    if m.experts_per_token < 1 or (m.n_experts and m.experts_per_token > m.n_experts):
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} must be in [1, model.n_experts="
                          f"{m.n_experts}]" if m.n_experts else f"model.experts_per_token={m.experts_per_token} "
                          f"must be >= 1")
    # Checked whether or not rope_scaling uses it: a nonsensical value is a mistake either way.
    if not 0 < m.rope_low_freq_factor <= m.rope_high_freq_factor:
        raise ConfigError(f"model.rope_low_freq_factor={m.rope_low_freq_factor} must be > 0 and <= "
                          f"model.rope_high_freq_factor={m.rope_high_freq_factor}")
    if m.attention in ("blockwise", "splash", "cudnn") and m.dropout > 0:
        raise ConfigError(f"model.attention={m.attention} has no dropout on attention probabilities but "
                          f"model.dropout={m.dropout}; use model.attention=dot_product (or auto) or model.dropout=0")
    if m.dropout > 0 and max(mesh.ici_sequence, mesh.dcn_sequence) > 1:
        raise ConfigError(f"model.dropout={m.dropout} drops attention probabilities, which context parallelism "
                          f"(mesh.ici_sequence={mesh.ici_sequence}, mesh.dcn_sequence={mesh.dcn_sequence}) "
                          f"does not; set model.dropout=0 or mesh.ici_sequence=mesh.dcn_sequence=1")
    if m.vision is not None and m.vision.kind in ("qwen2_5", "qwen3") and sum(m.vision.mrope) != m.hd // 2:
        raise ConfigError(f"model.vision.mrope_section={m.vision.mrope_section!r} must sum to the language model's "
                          f"head_dim / 2 = {m.hd // 2}")
    if m.vision is not None and len(m.vision.deepstack) > m.n_layers:
        raise ConfigError(f"model.vision.deepstack_layers={m.vision.deepstack_layers!r} feeds more layers than the "
                          f"language model's {m.n_layers}")
    _validate_family_options(m)


def _validate_family_options(m: ModelConfig) -> None:
    """The options of the 2025 families: rope scaling, latent attention, routers, layer layouts, MTP."""
    if m.latent:
        for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(m, key):
                raise ConfigError(f"model.kv_lora_rank={m.kv_lora_rank} (latent attention) needs model.{key} > 0")
        if m.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary pairs)")
        clash = [k for k in ("qk_norm", "qkv_bias", "bias", "attn_out_bias", "qk_l2_norm") if getattr(m, k)]
        if clash or m.position != "rotary":
            what = f"model.{clash[0]}=true" if clash else f"model.position={m.position}"
            raise ConfigError(f"{what} is not supported with latent attention (model.kv_lora_rank > 0); turn it off")
    elif m.q_lora_rank:
        raise ConfigError(f"model.q_lora_rank={m.q_lora_rank} needs latent attention (model.kv_lora_rank > 0)")
    if m.n_experts:
        if m.n_experts % m.router_groups:
            raise ConfigError(f"model.router_groups={m.router_groups} must divide model.n_experts={m.n_experts}")
        if not 1 <= m.router_topk_groups <= m.router_groups:
            raise ConfigError(f"model.router_topk_groups={m.router_topk_groups} must be in [1, model.router_groups="
                              f"{m.router_groups}]")
        reachable = m.router_topk_groups * (m.n_experts // m.router_groups)
        if m.experts_per_token > reachable:
            raise ConfigError(f"model.experts_per_token={m.experts_per_token} exceeds the {reachable} experts of "
                              f"model.router_topk_groups={m.router_topk_groups} groups; raise router_topk_groups")
        if m.first_dense_layers > m.n_layers:
            raise ConfigError(f"model.first_dense_layers={m.first_dense_layers} must be <= model.n_layers="
                              f"{m.n_layers}")
    if m.mtp_layers and m.position != "rotary":
        raise ConfigError(f"model.mtp_layers={m.mtp_layers} needs model.position=rotary")


def _validate_optimizer_and_training(o: OptimizerConfig, t: TrainingConfig) -> None:
    if not 0.0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be in [0, optimizer.lr={o.lr}]")
    decay = o.decay_steps if o.decay_steps is not None else t.steps
    if o.schedule != "constant" and decay < o.warmup_steps:
        length = f"optimizer.decay_steps={decay}" if o.decay_steps is not None else f"training.steps={decay}"
        raise ConfigError(f"{length} must be >= optimizer.warmup_steps={o.warmup_steps} (the schedule's length "
                          "includes its warmup): shorten the warmup or lengthen the run")
    if o.schedule == "wsd" and o.cooldown_steps is not None and o.cooldown_steps > decay - o.warmup_steps:
        raise ConfigError(f"optimizer.cooldown_steps={o.cooldown_steps} is longer than the {decay - o.warmup_steps} "
                          f"steps between optimizer.warmup_steps={o.warmup_steps} and the end of the decay "
                          f"(optimizer.decay_steps or training.steps={decay})")


def _validate_grpo(cfg: Config) -> None:
    g, t = cfg.grpo, cfg.training
    if t.objective != "grpo":
        return
    if not cfg.data.prompts:
        raise ConfigError("training.objective=grpo needs data.prompts=FILE.jsonl (records with `prompt` or "
                          "`messages`)")
    if not g.reward:
        raise ConfigError("training.objective=grpo needs grpo.reward=MODULE:FUNCTION (e.g. "
                          "jaxlm.rewards:exact_answer)")
    if g.group_size == 1:
        raise ConfigError("grpo.group_size=1 leaves every completion alone in its group, so every advantage is 0 and "
                          "nothing is learned; use 2 or more (8 is common)")
    rows = t.batch_size * t.grad_accum
    if rows % g.group_size:
        raise ConfigError(f"training.batch_size x training.grad_accum = {rows} completions per step must be a "
                          f"multiple of grpo.group_size={g.group_size} (whole groups per step)")
    if t.steps % g.iterations:
        raise ConfigError(f"training.steps={t.steps} must be a multiple of grpo.iterations={g.iterations} "
                          "(each batch of rollouts serves that many updates)")
    if cfg.checkpoint.interval % g.iterations:
        raise ConfigError(f"checkpoint.interval={cfg.checkpoint.interval} must be a multiple of grpo.iterations="
                          f"{g.iterations}: a checkpoint is taken between batches of rollouts")
    if g.max_completion_tokens >= cfg.model.block_size:
        raise ConfigError(f"grpo.max_completion_tokens={g.max_completion_tokens} must be below model.block_size="
                          f"{cfg.model.block_size}, which holds prompt and completion")


def _validate_lora(cfg: Config) -> None:
    lo = cfg.lora
    if not lo.rank:
        if lo.base_quantization != "none":
            raise ConfigError(f"lora.base_quantization={lo.base_quantization} quantizes the frozen base of a LoRA "
                              "run; set lora.rank too (e.g. lora.rank=16)")
        return
    names = [t.strip() for t in lo.targets.split(",") if t.strip()]
    if not names:
        raise ConfigError(f"lora.targets={lo.targets!r} is empty; name some of: {', '.join(LORA_TARGETS)}")
    for name in names:
        if name not in LORA_TARGETS:
            hint = difflib.get_close_matches(name.removesuffix("_proj"), LORA_TARGETS, n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise ConfigError(f"lora.targets={lo.targets!r}: {name!r} is not a weight jaxlm adapts{extra}; choose "
                              f"from {', '.join(LORA_TARGETS)}")
    if max(cfg.mesh.ici_stage, cfg.mesh.dcn_stage) > 1:
        raise ConfigError("lora.rank with pipeline stages (mesh.ici_stage / mesh.dcn_stage > 1) is not supported; "
                          "use FSDP (mesh.ici_fsdp) to spread the frozen base instead")
    if cfg.optimizer.qk_clip:
        raise ConfigError(f"optimizer.qk_clip={cfg.optimizer.qk_clip} rescales the query and key weights, which a LoRA "
                          "run keeps frozen; set optimizer.qk_clip=0 for lora.rank > 0")


def _validate_preference(cfg: Config) -> None:
    if cfg.training.objective in PREFERENCE_OBJECTIVES:
        if cfg.data.mixture:
            raise ConfigError(f"training.objective={cfg.training.objective} reads one preference dataset; "
                              "data.mixture is not supported with it (prepare the records together instead)")
        if cfg.data.loss_mask == "off":
            raise ConfigError(f"training.objective={cfg.training.objective} scores the replies, which the preference "
                              "data's loss mask marks; set data.loss_mask=auto")


def _validate_mesh_and_distributed(mesh: MeshConfig, d: DistributedConfig) -> None:
    for level in ("ici", "dcn"):
        fill = [f"mesh.{level}_{axis}" for axis in MESH_AXES if getattr(mesh, f"{level}_{axis}") == -1]
        if len(fill) > 1:
            raise ConfigError(f"{' and '.join(fill)} are all -1; at most one {level} axis may fill the remaining devices")
    if d.coordinator_address is not None and (d.num_processes is None or d.process_id is None):
        raise ConfigError("distributed.coordinator_address needs distributed.num_processes and distributed.process_id")
    if d.process_id is not None and d.num_processes is not None and not 0 <= d.process_id < d.num_processes:
        raise ConfigError(f"distributed.process_id={d.process_id} must be in [0, {d.num_processes})")


def _validate_diagnostics(cfg: Config) -> None:
    t = cfg.training
    dg, pr = cfg.diagnostics, cfg.profiler
    if dg.hang_exit and not dg.hang_timeout_seconds:
        raise ConfigError("diagnostics.hang_exit=true needs diagnostics.hang_timeout_seconds > 0")
    if (pr.mode == "xplane" or cfg.debug) and pr.skip_steps >= t.steps:
        raise ConfigError(f"profiler.skip_steps={pr.skip_steps} leaves no step to trace in training.steps={t.steps}; "
                          f"use at most {t.steps - 1}")
    if not cfg.logging.wandb_project:
        raise ConfigError("logging.wandb_project must not be empty")


def stop_token_ids(d: DecodeConfig) -> tuple[int, ...]:
    try:
        ids = tuple(int(t) for t in d.stop_tokens.replace(" ", "").split(",") if t)
    except ValueError:
        raise ConfigError(f"decode.stop_tokens={d.stop_tokens!r} must be comma-separated token ids, e.g. 0,2") from None
    if any(i < 0 for i in ids):
        raise ConfigError(f"decode.stop_tokens={d.stop_tokens!r} must hold ids >= 0")
    return ids


def draft_tokens(d: DecodeConfig, mtp: bool) -> int:
    """The tokens the draft proposes per pass of the model: decode.draft_tokens, or by default 3 for a draft
    model and 1 for the model's own multi-token prediction module (`mtp`); docs/generate.md measures why."""
    if d.draft_tokens is not None:
        return d.draft_tokens
    return 1 if mtp else 3


def validate_decode(d: DecodeConfig) -> None:
    check_fields(d, "decode.")
    if d.draft and d.draft != "mtp" and not Path(d.draft).exists():
        raise ConfigError(f"decode.draft={d.draft} does not exist; give the draft model's run directory or "
                          "converted folder, or `mtp` for the model's own multi-token prediction module")
    stop_token_ids(d)


def validate_serve(s: ServeConfig) -> None:
    check_fields(s, "serve.")
    if s.max_slots % s.replicas:
        raise ConfigError(f"serve.max_slots={s.max_slots} must be a multiple of serve.replicas={s.replicas} "
                          "(each replica takes an equal share of the slots)")
    if s.uds:
        validate_uds(s.uds)
    if s.api_key_file and not Path(s.api_key_file).is_file():
        raise ConfigError(f"serve.api_key_file={s.api_key_file} is not a file; give a file whose first line is the key")
    if s.chat_template and not Path(s.chat_template).is_file():
        raise ConfigError(f"serve.chat_template={s.chat_template} is not a file; give a Jinja chat template file")
    serve_adapters(s)
    if s.attention_kernel_options:
        if s.attention_kernel != "ragged":
            raise ConfigError(f"serve.attention_kernel_options={s.attention_kernel_options} sets the ragged kernel; "
                              f"set serve.attention_kernel=ragged too (it is {s.attention_kernel})")
        kernel_options(s.attention_kernel_options)


# serve.attention_kernel_options' keys and types: model/ragged_paged.py's Kernel's fields but `interpret`
KERNEL_OPTIONS = {"block_tokens": int, "row_bytes": int, "heads_batched": bool, "page_steps": bool, "prefetch": int,
                  "packed_kv": bool, "lanes_in_kernel": bool, "write_kernel": bool}


def kernel_options(text: str) -> dict:
    """serve.attention_kernel_options, "KEY=VALUE,..." (KERNEL_OPTIONS; integers >= 1, flags 0 or 1), as the
    ragged kernel's keyword arguments (ragged_paged.Kernel); '' gives none. A bad entry is a ConfigError."""
    out = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        key, eq, value = (x.strip() for x in entry.partition("="))
        kind = KERNEL_OPTIONS.get(key)
        ok = value in ("0", "1") if kind is bool else value.isdigit() and int(value) >= 1
        if not eq or kind is None or not ok or key in out:
            raise ConfigError(f"serve.attention_kernel_options entry {entry!r} must be KEY=VALUE with KEY one of "
                              f"{', '.join(KERNEL_OPTIONS)} (once each), an integer >= 1 or, for the flags "
                              "(heads_batched, page_steps, packed_kv, lanes_in_kernel, write_kernel), 0 or 1 (e.g. "
                              "heads_batched=1,block_tokens=256)")
        out[key] = kind(int(value))
    return out


UDS_MAX_BYTES = 107  # a unix socket's path, as sockaddr_un holds it on Linux (108 bytes with its final NUL)


def validate_uds(path: str) -> None:
    """serve.uds: a path a unix socket can be bound at; a file already there must be a socket (a stale one is
    replaced at start, as uvicorn and gunicorn do), never a file the server would destroy."""
    size = len(path.encode("utf-8", "surrogateescape"))  # the bytes the OS is given
    if size > UDS_MAX_BYTES:
        raise ConfigError(f"serve.uds={path} is {size} bytes long; a unix socket path holds at most {UDS_MAX_BYTES}: "
                          "choose a shorter one")
    p = Path(path)
    if not p.parent.is_dir():
        raise ConfigError(f"serve.uds={path}: the folder {p.parent} does not exist; create it or choose another path")
    if (p.exists() or p.is_symlink()) and not p.is_socket():
        raise ConfigError(f"serve.uds={path} exists and is not a socket; remove it or choose another path")


def serve_adapters(s: ServeConfig) -> list[tuple[str, str]]:
    """serve.adapters as (name, path) pairs; a malformed entry, a repeated name or a missing path stops in one
    line."""
    out = []
    for entry in (e.strip() for e in s.adapters.split(",")):
        if not entry:
            continue
        name, sep, path = (x.strip() for x in entry.partition("="))
        if not (sep and name and path):
            raise ConfigError(f"serve.adapters entry {entry!r} must be NAME=PATH (e.g. sql=runs/sql-lora)")
        if name in (n for n, _ in out):
            raise ConfigError(f"serve.adapters names {name!r} twice; give each adapter its own name")
        if not Path(path).is_dir():
            raise ConfigError(f"serve.adapters: {name}={path} is not a folder; give a PEFT adapter folder, a LoRA run "
                              "directory or a converted folder with an imported adapter")
        out.append((name, path))
    return out


def validate_compile(c: CompileConfig) -> None:
    check_fields(c, "compile.")
