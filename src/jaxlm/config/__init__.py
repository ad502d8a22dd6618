"""Run configuration: frozen dataclasses, presets, key=value overrides and validation.

A config is built in three layers: the dataclass defaults, a base (a preset module under
`jaxlm/configs/` or a YAML/JSON file), then dotted `key=value` overrides from the command line.
Every mistake a user can make here ends in a `ConfigError` whose message is one line naming the
key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import math
import pkgutil
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A user-fixable configuration mistake; its message is a single line."""


def _f(default, help: str, **kw):
    """A dataclass field with a help string shown by `jaxlm train --help`."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


DType = Literal["float32", "bfloat16"]
ATTENTION_KINDS = ("global", "local", "chunked", "nope")
RematPolicy = Literal["none", "full", "minimal", "save_dots", "save_qkv_proj", "save_out_proj", "save_qkv_out_proj",
                      "save_attention", "offload_qkv_proj", "offload_attention", "offload_layer_inputs"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int | None = _f(None, "vocabulary size; None takes it from the data's meta.json")
    block_size: int = _f(256, "context length in tokens")
    n_layers: int = _f(6, "number of transformer blocks")
    n_heads: int = _f(6, "query heads per block")
    n_kv_heads: int | None = _f(None, "key/value heads (grouped-query attention); None = n_heads")
    d_model: int = _f(384, "residual stream width")
    head_dim: int | None = _f(None, "width of one attention head; None = d_model / n_heads")
    d_ff: int | None = _f(None, "MLP hidden width; None = 4 * d_model")
    dropout: float = _f(0.0, "dropout rate on attention probabilities and residual branches")
    bias: bool = _f(False, "biases in linear layers and LayerNorm")
    norm: Literal["rmsnorm", "layernorm"] = _f("rmsnorm", "normalization layer")
    norm_eps: float = _f(1e-5, "epsilon of the normalization layers")
    position: Literal["rotary", "learned"] = _f("rotary", "position encoding")
    rope_theta: float = _f(10000.0, "rotary embedding base")
    qk_norm: bool = _f(True, "normalize queries and keys per head before attention (QK-LayerNorm)")
    activation: Literal["gelu", "gelu_tanh", "silu", "relu"] = _f("gelu", "MLP activation")
    glu: bool = _f(False, "gated MLP (SwiGLU/GeGLU) instead of a plain two-layer MLP")
    tie_embeddings: bool = _f(True, "share the token embedding with the output projection")
    init_std: float = _f(0.02, "standard deviation of the normal weight initializer")
    param_dtype: DType = _f("float32", "dtype the weights are stored and updated in")
    compute_dtype: DType = _f("float32", "dtype of activations and matmul operands (softmax and loss stay float32)")
    remat: RematPolicy = _f("none", "activation rematerialization: none, full, minimal (save matmuls without a "
                                    "batch dim), save_dots, save_qkv_proj / save_out_proj / save_qkv_out_proj / "
                                    "save_attention (keep those named activations, recompute the rest), "
                                    "offload_qkv_proj / offload_attention (move them to host memory; TPU and GPU), "
                                    "offload_layer_inputs (full remat, each layer's input kept in host memory); "
                                    "docs/performance.md")
    attention: Literal["auto", "dot_product", "blockwise", "splash", "cudnn"] = _f(
        "auto",
        "attention implementation: dot_product (materializes the [T, T] scores), blockwise (plain-JAX online "
        "softmax, O(T x block) memory), splash (Pallas TPU kernel; lengths a multiple of 128), cudnn (GPU flash "
        "kernel; bf16/fp16 without soft-cap or segment ids), auto (splash on TPU, cudnn on GPU, on CPU "
        "dot_product below 2048 tokens and blockwise from there; cases a kernel lacks use blockwise)")
    attention_block: int = _f(512, "query and key tile length of blockwise and splash attention")
    context_parallel: Literal["ring", "all_gather"] = _f(
        "ring",
        "attention when the mesh splits the sequence (mesh.ici_sequence / dcn_sequence > 1): ring (key/value blocks "
        "passed around the sequence devices, blockwise tiles; memory 1/n per device) or all_gather (every device "
        "gathers all keys and values; one collective per layer); docs/scaling.md")
    loss_chunk_tokens: int = _f(512, "compute the output projection and cross-entropy of the training loss this "
                                     "many sequence positions at a time for longer sequences, recomputing each "
                                     "chunk's logits in the backward pass, so the [B, T, V] float32 logits never "
                                     "exist at once (the loss is the same); 0 = all at once")
    scan_layers: bool = _f(True, "run the stacked layers with lax.scan (fast compile) instead of a Python loop")
    global_parameter_scale: int = _f(1, "multiply the non-embedding parameters by about this power of 2, "
                                        "growing width, heads, MLP width (and layers every third doubling)")
    # Family options (GPT-2, Llama, Mistral, Mixtral, Gemma, Gemma 2, Qwen): each is one named switch in the one
    # forward pass; docs/families.md maps every family to its values.
    qkv_bias: bool = _f(False, "biases on the query/key/value projections only (Qwen 2); `bias` turns on every bias")
    norm_plus_one: bool = _f(False, "RMSNorm multiplies by (1 + scale) with scale initialized to 0 (Gemma)")
    embed_scale: bool = _f(False, "multiply token embeddings by sqrt(d_model) (Gemma)")
    post_norms: bool = _f(False, "also normalize each block's attention and MLP output before the residual add (Gemma 2)")
    attn_scale: float | None = _f(None, "attention logits are multiplied by attn_scale ** -0.5; None = head_dim (Gemma 2 query_pre_attn_scalar)")
    attn_logit_softcap: float | None = _f(None, "cap * tanh(logits / cap) on attention logits; None = off (Gemma 2: 50)")
    final_logit_softcap: float | None = _f(None, "cap * tanh(logits / cap) on output logits; None = off (Gemma 2: 30)")
    sliding_window: int | None = _f(None, "keys a `local` layer attends to, itself included (Mistral, Gemma 2)")
    layer_pattern: str = _f("global", "comma-separated attention kinds repeated over the layers: global, local "
                            "(the last model.sliding_window positions), chunked (positions of the same "
                            "model.attention_chunk block, Llama 4), nope (global without rotary embeddings, "
                            "Llama 4), e.g. local,global for Gemma 2; layers are scanned in groups of this length "
                            "(a last group shorter than the pattern runs unrolled, as Gemma 3's 26 layers of 6)")
    attention_chunk: int | None = _f(None, "positions of one block of `chunked` layers (Llama 4: 8192)")
    local_rope_theta: float | None = _f(None, "rotary base of `local` layers, which then rotate without "
                                              "model.rope_scaling (Gemma 3: 10000); None = as global layers")
    rope_scaling: Literal["none", "llama3", "linear", "yarn"] = _f(
        "none", "rotary frequency scaling for long context: llama3 (Llama 3.1), linear (positions divided by "
                "rope_scaling_factor, Gemma 3's global layers), yarn (gpt-oss, DeepSeek-V3)")
    rope_scaling_factor: float = _f(8.0, "llama3/linear/yarn rope scaling: the context extension factor")
    rope_low_freq_factor: float = _f(1.0, "llama3 rope scaling: low_freq_factor")
    rope_high_freq_factor: float = _f(4.0, "llama3 rope scaling: high_freq_factor")
    rope_original_context: int = _f(8192, "llama3/yarn rope scaling: context length the model was pretrained with")
    rope_yarn_beta_fast: float = _f(32.0, "yarn rope scaling: beta_fast (rotations below which frequencies are "
                                          "interpolated)")
    rope_yarn_beta_slow: float = _f(1.0, "yarn rope scaling: beta_slow")
    rope_yarn_truncate: bool = _f(True, "yarn rope scaling: round the correction range to whole dimensions")
    rope_yarn_mscale: float = _f(0.0, "yarn rope scaling: mscale (with mscale_all_dim, the rotary attention "
                                      "factor is their ratio); 0 = unset")
    rope_yarn_mscale_all_dim: float = _f(0.0, "yarn rope scaling: mscale_all_dim; also multiplies the attention "
                                              "scale by (0.1 * mscale_all_dim * ln(factor) + 1)^2, as DeepSeek-V3 "
                                              "does; 0 = unset")
    rope_attention_factor: float | None = _f(None, "yarn rope scaling: factor on the rotated queries and keys; "
                                                   "None = from the factor and mscales")
    attn_out_bias: bool = _f(False, "a bias on the attention output projection (gpt-oss, with qkv_bias)")
    attn_sinks: bool = _f(False, "a learned logit per query head in every softmax denominator (gpt-oss)")
    qk_l2_norm: bool = _f(False, "queries and keys divided by their root mean square (no learned scale) after "
                                 "rotary, on layers with rotary (Llama 4's use_qk_norm)")
    attn_temperature_tuning: bool = _f(False, "on `nope` layers, queries multiplied by "
                                              "1 + attn_temperature_scale * ln(1 + floor((position + 1) / "
                                              "attn_temperature_floor)) (Llama 4)")
    attn_temperature_floor: int = _f(8192, "attention temperature tuning: floor_scale")
    attn_temperature_scale: float = _f(0.1, "attention temperature tuning: attn_scale")
    kv_lora_rank: int = _f(0, "multi-head latent attention (DeepSeek-V2/V3): width of the compressed key/value "
                              "latent that the KV cache stores; 0 = ordinary attention")
    q_lora_rank: int = _f(0, "latent attention: width of the compressed query; 0 = a full-rank query projection")
    qk_nope_head_dim: int = _f(0, "latent attention: per-head query/key width without rotary")
    qk_rope_head_dim: int = _f(0, "latent attention: width of the rotary query part and of the rotary key shared "
                                  "by all heads")
    v_head_dim: int = _f(0, "latent attention: per-head value width")
    n_experts: int = _f(0, "experts per mixture-of-experts MLP; 0 = dense MLP (Mixtral: 8)")
    experts_per_token: int = _f(2, "experts each token is routed to (top-k)")
    expert_capacity_factor: float = _f(
        0.0, "with experts split over devices (mesh expert axis > 1): token copies each device sends an expert, as "
        "a multiple of an even share (copies / n_experts); the overflow is dropped and its weight left to the "
        "residual. 0 = dropless (buffers sized for the worst case)")
    expert_all_to_all: Literal["auto", "ragged", "padded"] = _f(
        "auto", "how expert-parallel token copies travel: ragged (jax.lax.ragged_all_to_all: only the filled rows; "
        "TPU), padded (all_to_all of whole buffers; any platform), auto = ragged on TPU except v5e, whose pod "
        "slices XLA:TPU does not compile it for")
    router_aux_loss_coef: float = _f(0.02, "weight of the load-balancing loss added to the training loss")
    expert_d_ff: int | None = _f(None, "hidden width of each expert (and, times n_shared_experts, of the shared "
                                       "expert); None = d_ff (Qwen3-MoE, DeepSeek-V3 and Llama 4 differ)")
    first_dense_layers: int = _f(0, "with experts: the first this many layers have a dense MLP of width d_ff "
                                    "(DeepSeek-V3's first_k_dense_replace)")
    moe_layer_interval: int = _f(1, "with experts: layer i (from 0) has experts when (i + 1) is a multiple of this, "
                                    "the others a dense MLP of width d_ff (Llama 4's interleave_moe_layer_step)")
    n_shared_experts: int = _f(0, "shared experts every token goes through besides its routed ones, one MLP of "
                                  "width n_shared_experts * expert_d_ff (DeepSeek-V3, Llama 4)")
    router_score: Literal["softmax", "sigmoid"] = _f(
        "softmax", "router scores: softmax over the experts (Mixtral, Qwen3-MoE, gpt-oss) or a sigmoid per expert "
                   "(DeepSeek-V3, Llama 4)")
    router_norm_topk: bool = _f(True, "the chosen experts' weights are their scores divided by the chosen scores' "
                                      "sum (Qwen3-MoE's norm_topk_prob); false = the scores themselves")
    router_scale: float = _f(1.0, "the chosen experts' weights are multiplied by this (DeepSeek-V3's "
                                  "routed_scaling_factor)")
    router_groups: int = _f(1, "group-limited routing: the experts form this many groups, and a token picks its "
                               "experts from the router_topk_groups groups whose two best scores sum highest "
                               "(DeepSeek-V3's n_group)")
    router_topk_groups: int = _f(1, "group-limited routing: groups a token picks from (DeepSeek-V3's topk_group)")
    router_bias: bool = _f(False, "a bias on the router logits (gpt-oss)")
    router_balance_bias: bool = _f(False, "a per-expert bias added to the scores for choosing experts only (not "
                                          "to their weights), moved towards balanced loads outside the gradient: "
                                          "DeepSeek-V3's auxiliary-loss-free balancing (e_score_correction_bias)")
    moe_bias_update_rate: float = _f(0.001, "with router_balance_bias: each step the bias of an expert that got "
                                            "more than the mean load falls by this, one that got less rises by "
                                            "this (DeepSeek-V3's gamma); 0 = frozen (fine-tuning)")
    router_weights_input: bool = _f(False, "the routing weight multiplies an expert's input instead of its output "
                                           "(Llama 4)")
    expert_bias: bool = _f(False, "biases on the experts' projections (gpt-oss)")
    swiglu_limit: float | None = _f(None, "gpt-oss's clamped SwiGLU: gate clipped to <= limit, up to [-limit, "
                                          "limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate); None = "
                                          "the plain gated MLP")
    swiglu_alpha: float = _f(1.702, "clamped SwiGLU: the sigmoid's slope")
    mtp_layers: int = _f(0, "multi-token prediction modules (DeepSeek-V3's num_nextn_predict_layers): module k "
                            "predicts the token k + 1 positions ahead from the previous depth's hidden state and "
                            "the embedding of the token k positions ahead")
    mtp_loss_weight: float = _f(0.3, "weight of the mean multi-token prediction loss added to the training loss")
    quantization: Literal["none", "int8", "fp8", "int8_weights"] = _f(
        "none",
        "matmul quantization: int8 (int8 x int8 -> int32 forward and backward), fp8 (e4m3 forward, e5m2 "
        "gradients; NVIDIA compute capability 8.9+), int8_weights (inference: weights stored in int8)",
    )
    quant_logits: bool = _f(False, "also quantize the output (logits) projection")
    quant_stochastic_rounding: bool = _f(True, "round int8 gradients stochastically (unbiased) instead of to nearest")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def pattern(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.layer_pattern.split(","))

    @property
    def expert_ff(self) -> int:
        return self.expert_d_ff or self.ff

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    @property
    def qk_dim(self) -> int:
        """Width of one head's query and key: head_dim, or the latent attention's nope + rope parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.latent else self.hd

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.latent else self.hd


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _f("shakespeare_char", "dataset name: shakespeare_char, python_stdlib, openwebtext, or a prepared folder's name")
    dir: str | None = _f(None, "folder with train.bin, val.bin and meta.json; None = data/<dataset>")
    input: str | None = _f(None, "local text file to prepare the dataset from when the folder is missing (no download)")
    tokenizer: str | None = _f(None, "tokenizer for text in and out (byte, a tiktoken encoding or .tiktoken file, a "
                                     "SentencePiece .model, a tokenizer.json or a folder holding one, a hub id); "
                                     "None = the model's tokenizer/ folder, else the dataset's meta.json "
                                     "(docs/data.md); a dataset prepared with another tokenizer is refused")
    packing: bool = _f(False, "rows of whole documents back to back, each with its own segment id and positions "
                              "from 0 (attention never crosses a document); false = random windows of the corpus. "
                              "Needs a dataset with document boundaries (`jaxlm prepare`, format 2)")
    mixture: str | None = _f(None, "train on several prepared folders sharing one tokenizer, each row drawn from one "
                                   "of them by weight: 'dirA:0.7,dirB:0.3' (replaces data.dir/data.dataset)")
    prompts: str | None = _f(None, "training.objective=grpo: a jsonl file of prompts, each a record with `prompt` "
                                   "text or chat `messages`; its other fields (e.g. `answer`) go to the rewards")
    eval_prompts: str | None = _f(None, "training.objective=grpo: held-out prompts (jsonl as data.prompts) answered "
                                        "greedily at each evaluation; their mean reward is eval_reward")
    loss_mask: Literal["auto", "on", "off"] = _f(
        "auto", "train only on the targets the dataset's loss mask marks (chat data: the assistant's tokens): "
                "auto = when the dataset has a mask, on = require one, off = train on every token")


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "muon"] = _f(
        "adamw", "adamw: AdamW on every weight; muon: Muon (orthogonalized momentum) on the hidden matrices of the "
                 "layers (attention, MLP, experts, router; per layer and per expert) and AdamW on embeddings, "
                 "output layer, norms and biases (optim.py; a LoRA run's adapters always train with AdamW)")
    lr: float = _f(1e-3, "peak learning rate (of every weight with adamw; of the AdamW group with muon)")
    min_lr: float = _f(1e-4, "learning rate at the end of the decay (the muon group's is scaled alike)")
    warmup_steps: int = _f(100, "linear warmup steps from 0 to lr")
    decay_steps: int | None = _f(None, "step at which the decay reaches min_lr; None = training.steps")
    schedule: Literal["cosine", "wsd", "linear", "constant"] = _f(
        "cosine", "after warmup: cosine or linear decay to min_lr at decay_steps; wsd = warmup-stable-decay: lr "
                  "held until the cooldown (cooldown_steps or cooldown_fraction) before decay_steps, then "
                  "cooldown_shape down to min_lr, so a run extended with a larger training.steps before its "
                  "cooldown starts continues exactly; constant = lr after warmup")
    cooldown_fraction: float = _f(0.2, "schedule=wsd: share of the steps up to decay_steps spent cooling down")
    cooldown_steps: int | None = _f(None, "schedule=wsd: length of the cooldown in steps; None = cooldown_fraction")
    cooldown_shape: Literal["linear", "cosine", "sqrt"] = _f(
        "linear", "schedule=wsd: shape of the cooldown from lr to min_lr: linear, cosine, or sqrt "
                  "(1 - sqrt(progress): most of the drop early; Hagele et al. 2024)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    weight_decay: float = _f(0.1, "weight decay (see weight_decay_mode); of the AdamW group with muon")
    weight_decay_mode: Literal["coupled", "independent"] = _f(
        "coupled",
        "coupled: decay multiplied by the scheduled lr (torch AdamW); independent: decay follows the "
        "schedule's shape but not the peak lr (midGPT)",
    )
    decay_embeddings: bool = _f(True, "apply weight decay to embedding tables (norms and biases never decay)")
    grad_clip: float = _f(1.0, "global gradient-norm clipping threshold; 0 disables")
    muon_lr: float | None = _f(None, "optimizer.name=muon: peak learning rate of the Muon group; None = lr (the "
                                     "update is scaled to an RMS of muon_rms, so both groups can share one rate)")
    muon_weight_decay: float | None = _f(None, "optimizer.name=muon: the Muon group's decoupled weight decay; "
                                               "None = weight_decay")
    muon_momentum: float = _f(0.95, "optimizer.name=muon: momentum of the gradient average Muon orthogonalizes")
    muon_nesterov: bool = _f(True, "optimizer.name=muon: Nesterov momentum (orthogonalize g + momentum * m)")
    muon_ns_steps: int = _f(5, "optimizer.name=muon: Newton-Schulz iterations per update")
    muon_rms: float = _f(0.2, "optimizer.name=muon: each orthogonalized update is scaled by muon_rms * "
                              "sqrt(max(fan_in, fan_out)), giving it about that RMS (AdamW's typical 0.2-0.4: "
                              "Moonlight); 0 = Keller Jordan's scale max(1, fan_out / fan_in) ** 0.5 instead")
    qk_clip: float = _f(0.0, "MuonClip (Kimi K2): after each update, a head whose largest attention logit in the "
                             "step exceeded this threshold has its query and key projections scaled so it would "
                             "not (per head; with QK-norm, the layer's shared norm scales by its worst head); the "
                             "largest logit of each layer is logged as attn_logit_max/<layer>. 0 = off (Kimi: 100)")


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = _f(5000, "optimizer steps to train for")
    objective: Literal["next_token", "dpo", "ipo", "orpo", "grpo"] = _f(
        "next_token", "what the train step minimizes (objectives.py): next_token = cross-entropy of the next token "
                      "(pretraining, and SFT with loss masks); dpo, ipo, orpo = preference tuning on data from "
                      "`jaxlm prepare preference` (dpo.*, orpo.* settings; docs/preference.md); grpo = reinforcement "
                      "learning on rewarded rollouts (grpo.*, data.prompts; docs/rl.md)")
    batch_size: int = _f(64, "sequences per micro-batch across all devices (the global batch); "
                             "ignored when per_device_batch_size is set")
    per_device_batch_size: float | None = _f(None, "sequences per device per micro-batch; the global batch is this "
                                                   "times the device count (may be fractional when some mesh axes "
                                                   "do not split the batch)")
    grad_accum: int = _f(1, "micro-batches accumulated per optimizer step")
    pipeline_microbatches: int = _f(0, "with mesh stages (mesh.ici_stage x mesh.dcn_stage > 1): pieces each "
                                       "accumulated micro-batch is cut into to flow through the pipeline; "
                                       "0 = the number of stages (docs/scaling.md)")
    pipeline_repeats: int = _f(1, "circular pipeline: times each micro-batch loops through the stages, each "
                                  "stage running 1/(stages x repeats) of the layers per pass; 1 = GPipe")
    eval_interval: int = _f(250, "evaluate train/val loss every this many steps (and at the end); 0 = only at the end")
    eval_batches: int = _f(20, "fixed held-out batches per split in each evaluation")
    log_interval: int = _f(10, "steps between metric flushes (every step is still recorded)")
    sample_tokens: int = _f(200, "tokens sampled at the end of training; 0 = no sample")
    sample_prompt: str = _f("\n", "prompt for the end-of-training sample")
    sample_temperature: float = _f(0.8, "sampling temperature for the end-of-training sample")
    sample_top_k: int = _f(200, "top-k for the end-of-training sample; 0 = off")
    on_nonfinite: Literal["skip", "stop"] = _f(
        "skip", "a step whose loss or gradient norm is NaN/inf is never applied; skip: go on with the next batch "
                "(up to max_consecutive_skips in a row), stop: end the run with an error")
    max_consecutive_skips: int = _f(20, "with on_nonfinite=skip, end the run when more steps than this in a row "
                                        "are not finite")
    spike_threshold: float = _f(0.0, "skip the update of a step whose loss exceeds this multiple of the running "
                                     "average loss (about the last 100 steps); 0 = off, else > 1")


@dataclass(frozen=True)
class LoraConfig:
    rank: int = _f(0, "LoRA adapter rank; 0 = off (every weight trains). With a rank only the adapters train: the "
                      "base weights (checkpoint.init_from) are frozen, get no gradient and no optimizer state, and "
                      "checkpoints hold the adapters (docs/finetune.md)")
    alpha: float = _f(16.0, "adapters add (alpha / rank) * x A B to each adapted projection")
    dropout: float = _f(0.0, "dropout on each adapter's input during training")
    targets: str = _f("q,k,v,o,up,gate,down", "comma-separated weights that get adapters: q, k, v, o (attention; "
                                              "Hugging Face q_proj, k_proj, v_proj, o_proj) and up, gate, down "
                                              "(dense MLP; up_proj, gate_proj, down_proj); experts are not adapted")
    base_quantization: Literal["none", "int8", "nf4"] = _f(
        "none", "QLoRA: keep the frozen base's attention and dense MLP weights on the device as int8 (one scale "
                "per output channel) or 4-bit NormalFloat (blocks of 64, double-quantized scales), dequantized "
                "layer by layer in the matmul; adapters and compute stay in their own dtypes")


@dataclass(frozen=True)
class DpoConfig:
    beta: float = _f(0.1, "training.objective=dpo|ipo: how far the policy may move from the reference model (the KL "
                          "weight beta; IPO's tau), as TRL's DPOConfig.beta")
    label_smoothing: float = _f(0.0, "training.objective=dpo: the probability that a pair's preference is flipped "
                                     "(conservative DPO), in [0, 0.5); 0 = plain DPO")


@dataclass(frozen=True)
class OrpoConfig:
    # `lambda` is a Python keyword: the field is lambda_, and users write orpo.lambda (ALIASES)
    lambda_: float = _f(0.1, "training.objective=orpo: weight of the odds-ratio term beside the chosen reply's "
                             "negative log-likelihood (the ORPO paper's lambda; TRL's ORPOConfig.beta)")


@dataclass(frozen=True)
class GrpoConfig:
    group_size: int = _f(8, "completions sampled per prompt; advantages compare each with its group's mean")
    max_completion_tokens: int = _f(256, "tokens a completion may take; it also stops at the tokenizer's EOS")
    temperature: float = _f(1.0, "sampling temperature of the rollouts (the loss's log-probabilities use it too)")
    top_p: float = _f(1.0, "nucleus sampling of the rollouts; 1 = off")
    top_k: int = _f(0, "top-k sampling of the rollouts; 0 = off")
    beta: float = _f(0.0, "weight of the KL penalty to the reference model (k3 estimator); 0 drops the reference "
                          "and its forward pass entirely")
    epsilon: float = _f(0.2, "the policy ratio is clipped to [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: float | None = _f(None, "upper clip (DAPO's asymmetric clip, e.g. 0.28); None = epsilon")
    iterations: int = _f(1, "policy updates per batch of rollouts (mu); the old policy's log-probabilities are "
                            "computed once per batch when > 1, and with 1 the ratio is exactly 1")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = _f(
        "dapo", "how token losses are averaged: grpo = each sequence's mean, then the mean over sequences; bnpo = "
                "over the micro-batch's completion tokens; dr_grpo = over sequences x max_completion_tokens (Dr. "
                "GRPO's constant); dapo = over all completion tokens of the step")
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group", "divide advantages (reward minus its group's mean) by the group's reward std, the batch's, or "
                 "nothing (Dr. GRPO)")
    reward: str = _f("", "reward functions, comma-separated MODULE:FUNCTION (MODULE a dotted name or a .py file), "
                         "e.g. jaxlm.rewards:exact_answer,my_rewards.py:concise; each is called with prompts, "
                         "completions, completion_ids and the records' other fields, and returns a float each")
    reward_weights: str = _f("", "comma-separated weights of the reward functions; '' = 1 each")
    mask_truncated: bool = _f(False, "leave completions cut at max_completion_tokens out of the loss")
    log_completions: int = _f(10, "every this many steps, write the rollouts' prompts, completions and rewards to "
                                  "<run_dir>/completions.jsonl; 0 = off")


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = _f(1000, "save every this many steps (and at the end); 0 = only at the end")
    keep: int = _f(3, "checkpoints kept on disk")
    enabled: bool = _f(True, "write checkpoints at all")
    async_save: bool = _f(True, "write checkpoints in the background while training continues")
    on_error: Literal["stop", "continue"] = _f("stop", "when a save fails (read-only or full disk): stop the run "
                                                       "with an error, or warn and try again at the next interval")
    save_on_preemption: bool = _f(True, "on SIGTERM or SIGINT, all processes agree on a step, save it, flush "
                                        "the logs and exit 0 (a second SIGINT aborts)")
    init_from: str | None = _f(None, "start from these weights (a `jaxlm convert from-hf` folder or a run directory) "
                                     "with a fresh optimizer, when run_dir holds no checkpoint yet")


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = _f(True, "write TensorBoard event files to the run directory")
    progress: bool = _f(True, "show a progress bar")
    wandb: bool = _f(False, "log metrics to Weights & Biases (pip install 'jaxlm[wandb]'; WANDB_MODE=offline works)")
    wandb_project: str = _f("jaxlm", "W&B project")
    wandb_entity: str | None = _f(None, "W&B entity (team or user); None = your default")
    wandb_run_name: str | None = _f(None, "W&B run name; None = the run directory's name")


MESH_AXES = ("data", "stage", "fsdp", "expert", "sequence", "tensor")


@dataclass(frozen=True)
class MeshConfig:
    ici_data: int = _f(-1, "data-parallel devices within a slice (or a host); -1 = all that remain")
    ici_fsdp: int = _f(1, "FSDP devices within a slice: shard params, grads and optimizer state; -1 = fill")
    ici_tensor: int = _f(1, "tensor-parallel devices within a slice: shard heads and MLP width; -1 = fill")
    ici_sequence: int = _f(1, "sequence-parallel devices within a slice: shard activations along length; -1 = fill")
    ici_expert: int = _f(1, "expert-parallel devices within a slice: shard MoE experts; -1 = fill")
    ici_stage: int = _f(1, "stage devices within a slice: shard the stacked layers; -1 = fill")
    dcn_data: int = _f(1, "data-parallel slices (or hosts) across the data-center network; -1 = fill")
    dcn_fsdp: int = _f(1, "FSDP across slices; -1 = fill")
    dcn_tensor: int = _f(1, "tensor parallelism across slices (rarely useful); -1 = fill")
    dcn_sequence: int = _f(1, "sequence parallelism across slices; -1 = fill")
    dcn_expert: int = _f(1, "expert parallelism across slices; -1 = fill")
    dcn_stage: int = _f(1, "stages across slices; -1 = fill")
    rules: str = _f("", "overrides of the logical-axis rules, e.g. 'param.embed=fsdp+sequence;act.length=' "
                        "(param./act. + logical axis = mesh axes joined by +, empty = replicated)")


@dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str | None = _f(None, "host:port of process 0 for jax.distributed; None = single process "
                                              "unless JAXLM_COORDINATOR is set (by `jaxlm launch`)")
    num_processes: int | None = _f(None, "processes in the job (with coordinator_address)")
    process_id: int | None = _f(None, "this process's index (with coordinator_address)")
    auto: bool = _f(False, "let JAX detect the cluster (TPU pods, Slurm, Open MPI, Kubernetes)")


@dataclass(frozen=True)
class DiagnosticsConfig:
    collect_stack_trace: bool = _f(False, "dump every thread's Python stack every stack_trace_interval_seconds")
    stack_trace_interval_seconds: float = _f(600.0, "seconds between stack dumps")
    stack_trace_to_file: bool = _f(False, "append the dumps to <run_dir>/debugging/stack_trace_<process>.txt instead of the console")
    hang_timeout_seconds: float = _f(0.0, "report a hang (stacks + a log line) when no step finishes for this long after the first; 0 = off")
    hang_exit: bool = _f(False, "after reporting a hang, exit with status 75 so a scheduler restarts the job from its last checkpoint")


@dataclass(frozen=True)
class ProfilerConfig:
    mode: Literal["none", "xplane"] = _f("none", "xplane: trace profiler.steps steps to <run_dir>/profile (TensorBoard/xprof); `profiler=xplane` for short")
    skip_steps: int = _f(3, "steps run after the (re)start before tracing begins; the first one compiles")
    steps: int = _f(5, "steps traced")
    port: int = _f(0, "serve jax.profiler on this port for on-demand capture from TensorBoard/xprof; 0 = off")


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = _f(200, "tokens generated per sample at most (fewer when a stop token comes first)")
    temperature: float = _f(0.8, "softmax temperature; 0 = greedy")
    top_k: int = _f(0, "sample only among the k most likely tokens; 0 = off")
    top_p: float = _f(1.0, "sample only from the smallest set of tokens whose probability reaches top_p (nucleus); 1 = off")
    seed: int = _f(0, "sampling seed: the same seed, prompt and settings give the same text")
    num_samples: int = _f(1, "samples generated for each prompt, decoded together as one batch")
    cache_length: int | None = _f(None, "positions the KV cache holds per sequence; None = longest prompt + max_new_tokens")
    quantize_kv_cache: bool = _f(False, "store cached keys and values as int8 with a float32 scale per position and kv head")
    stop_tokens: str = _f("", "comma-separated token ids that end a sample (it is kept in the output)")
    stop_at_eos: bool = _f(True, "also stop at the model's end-of-sequence token, when its tokenizer names one")
    draft: str = _f("", "`jaxlm generate` and `jaxlm serve`: a smaller model with the same tokenizer (run directory "
                        "or converted folder) that proposes tokens for the model to verify several at a time "
                        "(speculative decoding: the same distribution, greedy text identical); `mtp`: the model's "
                        "own first multi-token prediction module drafts (DeepSeek-V3's)")
    draft_tokens: int | None = _f(None, "tokens the draft proposes per forward pass of the model (decode.draft); "
                                        "None = 3 for a draft model, 1 for `mtp` (DeepSeek-V3's setting: the "
                                        "module reused on its own output rarely proposes right)")


@dataclass(frozen=True)
class ServeConfig:
    host: str = _f("127.0.0.1", "`jaxlm serve`: address to listen on; 0.0.0.0 opens the server to the network")
    port: int = _f(8000, "`jaxlm serve`: TCP port")
    uds: str = _f("", "`jaxlm serve`: listen on a unix domain socket at this path instead of serve.host:port (a "
                      "machine that refuses TCP sockets, a reverse proxy or sidecar in front); a socket file left by "
                      "a server that is gone is replaced; '' = TCP")
    max_slots: int = _f(64, "sequences in flight at most (decoded together; the decode step compiles for this "
                            "count, a half, a quarter and an eighth of it, and 4 and 1); with the slot cache "
                            "(serve.page_size=0) each holds the whole context")
    page_size: int = _f(16, "positions per page of the paged KV cache: a sequence holds the pages its tokens fill, "
                            "taken as it grows and given back when it ends; 0 = the slot cache (every slot the "
                            "whole context)")
    cache_gib: float = _f(0.0, "memory of the paged KV cache's pages, GiB; 0 = as much as gives every slot the "
                               "whole context, at most 4 GiB on a CPU and 80% of the free memory on an "
                               "accelerator")
    max_queue: int = _f(64, "sequences waiting for a slot at most; more are answered 429 with Retry-After, and a "
                            "request of more sequences than this (prompts x n) 400")
    model_name: str = _f("", "model id of the OpenAI API (/v1/models, the `model` field); '' = the folder's name")
    adapters: str = _f("", "LoRA adapters served over the model, as NAME=PATH,... (PATH a PEFT adapter folder, a LoRA "
                           "run directory or a converted folder with an imported adapter): a request whose `model` "
                           "is NAME runs with that adapter, and requests for different adapters share decode "
                           "steps; /v1/models lists them")
    api_key: str = _f("", "answer 401 unless a request sends `Authorization: Bearer KEY`; '' = the JAXLM_API_KEY "
                          "environment variable, or no key when that is unset")
    api_key_file: str = _f("", "a file holding the API key (its first line), so that the key is not in the command "
                               "line that `ps` shows; used when serve.api_key is ''")
    allowed_hosts: str = _f("", "comma-separated Host header values answered (port left out; '*' = any); '' = "
                                "localhost, 127.0.0.1 and ::1 when serve.host is a loopback address (a web page "
                                "that rebinds its name to 127.0.0.1 is refused), any when it is not or when "
                                "serve.uds is set (a browser cannot reach a unix socket; a proxy in front decides)")
    allowed_origins: str = _f("", "comma-separated Origin values (e.g. https://app.example) whose cross-origin "
                                  "requests are answered; '' = none: a request that a browser sends from another "
                                  "site is refused (403)")
    max_body_mb: float = _f(8.0, "request bodies larger than this many MiB are refused (413) before they are read; "
                                 "the rest is read and thrown away (up to 256 MiB, for 30 s at most) so that "
                                 "clients that send the whole body first read the 413")
    max_header_kb: float = _f(32.0, "a request's line and headers larger than this many KiB are answered 431 and the "
                                    "connection closed, before more of them is read (nginx takes 32 KiB)")
    max_headers: int = _f(100, "headers per request at most; more are answered 431")
    header_timeout_s: float = _f(10.0, "a connection must send a request's line and headers within this many seconds "
                                       "of opening, or of its previous answer: 408 and closed (closed silently "
                                       "when nothing of a request came)")
    body_timeout_s: float = _f(60.0, "a request's body must arrive within this many seconds of its headers (408)")
    max_connections: int = _f(1024, "open connections at most; past them new requests are answered 503")
    max_tokenize_chars: int = _f(1 << 20, "/tokenize texts longer than this many characters are answered 413")
    chat_template: str = _f("", "a Jinja chat template file for /v1/chat/completions when the tokenizer has none")
    prefill_chunk: int = _f(512, "prompt tokens prefilled per engine turn at most: a longer prompt is prefilled a "
                                 "chunk per turn between the other slots' decode steps; prefill compiles once per "
                                 "chunk length (powers of two from 16 up to this)")
    prefix_cache: int = _f(4, "share prompt prefixes: with the paged cache (any value > 0) a prompt's full pages stay "
                              "registered and a later prompt that starts with the same tokens takes them instead of "
                              "prefilling; with the slot cache, this many recent prompts' keys and values stay on "
                              "device (each one slot's memory) to be copied into a slot; 0 = off")
    decode_steps: int = _f(8, "decode steps run in one device call at most, each row stopping at its stop token or "
                              "max_tokens inside the call; a turn that prefills runs one step (a new request's "
                              "first token), the others this many; 1 = one step per call")
    replicas: int = _f(1, "engines over the same weights on one device, each with max_slots / replicas slots, its "
                          "own KV cache and thread; a request goes to the least busy. XLA:CPU runs one decode "
                          "program on about one core, so on a CPU host two replicas use two (docs/serve.md); keep "
                          "1 on an accelerator")


@dataclass(frozen=True)
class CompileConfig:
    topology: str = _f("", "target of `jaxlm compile`: a TPU slice such as v4-8, v5e-16, v5e-256, v5p-128, v6e-256 "
                           "(or v5e:4x4 / v5p:4x4x12; needs the tpu extra), cpu-N (N CPU devices), or a3 (8 x H100 "
                           "per host; compile on a GPU host)")
    num_slices: int = _f(1, "TPU slices (or a3 hosts) the step is compiled for; mesh.dcn_* axes span them")
    output: str | None = _f(None, "`jaxlm compile`: save the compiled train step and its signature to this file")
    load: str | None = _f(None, "`jaxlm train`: run the train step saved by `jaxlm compile compile.output=FILE` "
                                "instead of compiling one; the run must match the settings it was compiled with")
    find_batch_size: bool = _f(False, "`jaxlm compile`: search the largest whole training.per_device_batch_size "
                                      "that fits the target by compiling candidates")
    max_batch_size: int = _f(1024, "largest per_device_batch_size the search tries")
    hbm_gib: float | None = _f(None, "memory per device the step must fit in, GiB; None = the chip's HBM "
                                     "(aot.HBM_GIB), or host memory / devices for cpu-N")
    cache_dir: str = _f("~/.cache/jaxlm/xla", "persistent XLA compilation cache: a rerun of the same step on the same "
                                                "devices loads it instead of compiling; '' = off. JAX's own "
                                                "JAX_COMPILATION_CACHE_DIR, when set, takes precedence")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    orpo: OrpoConfig = field(default_factory=OrpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    run_dir: str | None = _f(None, "run directory (a path, a file:// URL, or an fsspec URL such as gs://... for "
                                         "metrics only, docs/scaling.md); None = outputs/<timestamp>. A folder "
                                         "holding a checkpoint is resumed")
    seed: int = _f(1337, "seed for initialization, data order and dropout")
    debug: bool = _f(False, "shortcut for profiler=xplane that also skips checkpoints")

    def replace(self, **kw) -> "Config":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)



def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: t for name, t in hints.items() if dataclasses.is_dataclass(t)}


def all_keys() -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, help) for every setting, in declaration order."""
    rows = []
    sections = _section_classes()
    defaults = Config()
    for f in dataclasses.fields(Config):
        if f.name in sections:
            hints = typing.get_type_hints(sections[f.name])
            for sf in dataclasses.fields(sections[f.name]):
                rows.append((f"{f.name}.{sf.name}", hints[sf.name],
                             getattr(getattr(defaults, f.name), sf.name), sf.metadata.get("help", "")))
        else:
            rows.append((f.name, typing.get_type_hints(Config)[f.name], getattr(defaults, f.name),
                         f.metadata.get("help", "")))
    return rows


def type_name(t) -> str:
    origin = typing.get_origin(t)
    if origin is Literal:
        return "|".join(str(a) for a in typing.get_args(t))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return f"{type_name(args[0])} or None" if len(args) == 1 else " or ".join(map(type_name, args))
    return getattr(t, "__name__", str(t))


def _coerce(key: str, value: Any, t) -> Any:
    """Convert `value` (a string from the command line, or a YAML/JSON scalar) to type `t`."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner)
    if origin is Literal:
        choices = typing.get_args(t)
        if value in choices:
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"{key}={value!r} is not allowed{extra}; choose one of: {', '.join(map(str, choices))}")
    try:
        if t is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if t is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            if isinstance(value, str):
                v = float(value.replace("_", ""))
                if not v.is_integer():
                    raise ValueError
                return int(v)
            if isinstance(value, int):
                return value
            raise ValueError
        if t is float:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):
                return float(value)
            raise ValueError
        if t is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not a valid {type_name(t)}") from None
    raise ConfigError(f"{key}: unsupported setting type {t}")


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    extra = f" (did you mean '{hint[0]}'?)" if hint else ""
    return ConfigError(f"unknown setting '{key}'{extra}; `jaxlm train --help` lists them all")


# Short spellings accepted on the command line and in files.
ALIASES = {"profiler": "profiler.mode", "orpo.lambda": "orpo.lambda_"}


def spelled(key: str) -> str:
    """A setting's key as users write it (`orpo.lambda` for the field orpo.lambda_)."""
    return next((alias for alias, k in ALIASES.items() if k == key and "." in alias), key)


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Return `cfg` with dotted-key overrides applied, type-checked; does not validate ranges."""
    sections = _section_classes()
    keys = [spelled(k) for k, *_ in all_keys()]
    top_hints = typing.get_type_hints(Config)
    changes: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in overrides.items():
        key = ALIASES.get(key, key)
        parts = key.split(".")
        if len(parts) == 1 and parts[0] in top_hints and parts[0] not in sections:
            top[parts[0]] = _coerce(key, value, top_hints[parts[0]])
        elif len(parts) == 2 and parts[0] in sections:
            hints = typing.get_type_hints(sections[parts[0]])
            if parts[1] not in hints:
                raise _unknown(key, keys)
            changes.setdefault(parts[0], {})[parts[1]] = _coerce(spelled(key), value, hints[parts[1]])
        else:
            raise _unknown(key, keys)
    for section, kv in changes.items():
        top[section] = dataclasses.replace(getattr(cfg, section), **kv)
    return dataclasses.replace(cfg, **top)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'model': {'n_layers': 4}} -> {'model.n_layers': 4}."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k in _section_classes() and not prefix:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_overrides(args: list[str]) -> dict[str, str]:
    out = {}
    for a in args:
        if "=" not in a:
            raise ConfigError(f"expected key=value, got {a!r} (e.g. training.steps=100)")
        k, v = a.split("=", 1)
        out[k.strip()] = v
    return out


def preset_names() -> list[str]:
    from jaxlm import configs

    return sorted(m.name for m in pkgutil.iter_modules(configs.__path__) if not m.name.startswith("_"))


def load_base(name_or_file: str, written: set[str] | None = None) -> Config:
    """A preset by name (`shakespeare_char`) or a YAML/JSON file of nested settings; the dotted keys a file (or
    the files it is based on) sets are added to `written`."""
    path = Path(name_or_file)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"config file {name_or_file} does not exist")
        text = path.read_text()
        try:
            if path.suffix == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as e:  # noqa: BLE001 - parser errors vary; report the first line
            raise ConfigError(f"cannot parse {name_or_file}: {str(e).splitlines()[0]}") from None
        data = data or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{name_or_file} must hold a mapping of settings, not {type(data).__name__}")
        base = load_base(data.pop("base"), written) if "base" in data else Config()
        settings = flatten(data)
        if written is not None:
            written.update(ALIASES.get(k, k) for k in settings)
        return apply_overrides(base, settings)
    name = name_or_file.replace("-", "_").replace(".", "_")
    names = preset_names()
    if name not in names:
        hint = difflib.get_close_matches(name, names, n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"unknown preset or file '{name_or_file}'{extra}; presets: {', '.join(names)}")
    return importlib.import_module(f"jaxlm.configs.{name}").config()


def load(name_or_file: str, overrides: dict[str, Any] | list[str] | None = None) -> Config:
    """Base + overrides, validated."""
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    overrides = overrides or {}
    written = {ALIASES.get(k, k) for k in overrides}
    cfg = apply_overrides(load_base(name_or_file, written), overrides)
    cfg, note = fit_warmup(cfg, explicit="optimizer.warmup_steps" in written)
    if note:
        print(f"note: {note}", file=sys.stderr)
    validate(cfg)
    return cfg


def fit_warmup(cfg: Config, explicit: bool) -> tuple[Config, str | None]:
    """A run shorter than the warmup it inherited (a preset's, or the default) trains: the warmup is cut to a
    tenth of the steps the schedule decays over, and the note says so. A warmup the user wrote is kept (and
    `validate` refuses it if the run is shorter)."""
    o = cfg.optimizer
    decay = o.decay_steps if o.decay_steps is not None else cfg.training.steps
    if explicit or o.schedule == "constant" or decay >= o.warmup_steps or decay < 0:
        return cfg, None
    cut = decay // 10
    return cfg.replace(optimizer=dataclasses.replace(o, warmup_steps=cut)), (
        f"optimizer.warmup_steps={o.warmup_steps} is longer than this run's {decay} steps of schedule: warmup cut "
        f"to {cut} (a tenth of them); set optimizer.warmup_steps to choose")


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
    """Range and consistency checks that need no data or devices, section by section."""
    if cfg.data.mixture is not None:
        parse_mixture(cfg.data.mixture)
    _validate_common(cfg)
    _validate_model(cfg.model, cfg.mesh)
    _validate_optimizer_and_training(cfg.optimizer, cfg.training, cfg.checkpoint)
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


def _positive(key, v) -> None:
    if v <= 0:
        raise ConfigError(f"{key}={v} must be > 0")


def _validate_common(cfg: Config) -> None:
    # NaN passes every `v <= 0` test below and infinity most of them; no setting means either.
    for key, *_ in all_keys():
        section, _, name = key.rpartition(".")
        v = getattr(getattr(cfg, section), name) if section else getattr(cfg, name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{spelled(key)}={v} must be a finite number")
    for key in ("seed", "decode.seed"):
        v = cfg.seed if key == "seed" else cfg.decode.seed
        if v < 0:
            raise ConfigError(f"{key}={v} must be >= 0")
    if cfg.run_dir == "":
        raise ConfigError("run_dir='' is empty; give a folder, or None for outputs/<timestamp>")



def _validate_model(m: ModelConfig, mesh: MeshConfig) -> None:
    for key in ("block_size", "n_layers", "n_heads", "d_model"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("vocab_size", "n_kv_heads", "head_dim", "d_ff"):
        v = getattr(m, key)
        if v is not None:
            _positive(f"model.{key}", v)
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} "
                          f"(allowed: {_divisors(m.d_model)}), or set model.head_dim")
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.kv_heads} must divide model.n_heads={m.n_heads} "
                          f"(allowed: {_divisors(m.n_heads)})")
    if m.position == "rotary" and m.hd % 2:
        raise ConfigError(f"rotary embeddings need an even head width, got {m.hd} (model.d_model / model.n_heads)")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    for key in ("norm_eps", "init_std", "rope_theta"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("attn_scale", "attn_logit_softcap", "final_logit_softcap", "sliding_window", "attention_chunk",
                "local_rope_theta", "rope_attention_factor", "expert_d_ff", "swiglu_limit"):
        v = getattr(m, key)
        if v is not None:
            _positive(f"model.{key}", v)
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
    if m.n_experts < 0:
        raise ConfigError(f"model.n_experts={m.n_experts} must be >= 0 (0 = dense MLP)")
    if m.experts_per_token < 1 or (m.n_experts and m.experts_per_token > m.n_experts):
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} must be in [1, model.n_experts="
                          f"{m.n_experts}]" if m.n_experts else f"model.experts_per_token={m.experts_per_token} "
                          f"must be >= 1")
    if m.expert_capacity_factor < 0:
        raise ConfigError(f"model.expert_capacity_factor={m.expert_capacity_factor} must be >= 0 (0 = dropless)")
    if m.router_aux_loss_coef < 0:
        raise ConfigError(f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be >= 0")
    # Checked whether or not rope_scaling uses them: a nonsensical value is a mistake either way.
    for key in ("rope_scaling_factor", "rope_original_context"):
        _positive(f"model.{key}", getattr(m, key))
    if not 0 < m.rope_low_freq_factor <= m.rope_high_freq_factor:
        raise ConfigError(f"model.rope_low_freq_factor={m.rope_low_freq_factor} must be > 0 and <= "
                          f"model.rope_high_freq_factor={m.rope_high_freq_factor}")
    _positive("model.attention_block", m.attention_block)
    if m.loss_chunk_tokens < 0:
        raise ConfigError(f"model.loss_chunk_tokens={m.loss_chunk_tokens} must be >= 0 (0 = off)")
    if m.attention in ("blockwise", "splash", "cudnn") and m.dropout > 0:
        raise ConfigError(f"model.attention={m.attention} has no dropout on attention probabilities but "
                          f"model.dropout={m.dropout}; use model.attention=dot_product (or auto) or model.dropout=0")
    if m.dropout > 0 and max(mesh.ici_sequence, mesh.dcn_sequence) > 1:
        raise ConfigError(f"model.dropout={m.dropout} drops attention probabilities, which context parallelism "
                          f"(mesh.ici_sequence={mesh.ici_sequence}, mesh.dcn_sequence={mesh.dcn_sequence}) "
                          f"does not; set model.dropout=0 or mesh.ici_sequence=mesh.dcn_sequence=1")
    if m.global_parameter_scale < 1 or m.global_parameter_scale & (m.global_parameter_scale - 1):
        raise ConfigError(f"model.global_parameter_scale={m.global_parameter_scale} must be a power of 2 (1, 2, 4, ...)")
    _validate_family_options(m)



def _validate_family_options(m: ModelConfig) -> None:
    """The options of the 2025 families: rope scaling, latent attention, routers, layer layouts, MTP."""
    for key in ("rope_yarn_beta_fast", "rope_yarn_beta_slow", "attn_temperature_floor", "attn_temperature_scale",
                "router_scale", "swiglu_alpha"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim", "first_dense_layers", "n_shared_experts",
                "moe_bias_update_rate", "mtp_layers", "mtp_loss_weight", "kv_lora_rank", "q_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be >= 0")
    for key in ("moe_layer_interval", "router_groups", "router_topk_groups"):
        _positive(f"model.{key}", getattr(m, key))
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


def _validate_optimizer_and_training(o: OptimizerConfig, t: TrainingConfig, c: CheckpointConfig) -> None:
    _positive("optimizer.lr", o.lr)
    if not 0.0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be in [0, optimizer.lr={o.lr}]")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"optimizer.{key}={getattr(o, key)} must be in [0, 1)")
    _positive("optimizer.eps", o.eps)
    for key in ("weight_decay", "grad_clip"):
        if getattr(o, key) < 0:
            raise ConfigError(f"optimizer.{key}={getattr(o, key)} must be >= 0")
    if o.warmup_steps < 0:
        raise ConfigError(f"optimizer.warmup_steps={o.warmup_steps} must be >= 0")
    decay = o.decay_steps if o.decay_steps is not None else t.steps
    if o.schedule != "constant" and decay < o.warmup_steps:
        length = f"optimizer.decay_steps={decay}" if o.decay_steps is not None else f"training.steps={decay}"
        raise ConfigError(f"{length} must be >= optimizer.warmup_steps={o.warmup_steps} (the schedule's length "
                          "includes its warmup): shorten the warmup or lengthen the run")
    if not 0.0 <= o.cooldown_fraction <= 1.0:
        raise ConfigError(f"optimizer.cooldown_fraction={o.cooldown_fraction} must be in [0, 1]")
    if o.cooldown_steps is not None and o.cooldown_steps < 0:
        raise ConfigError(f"optimizer.cooldown_steps={o.cooldown_steps} must be >= 0 (or None: cooldown_fraction)")
    if o.schedule == "wsd" and o.cooldown_steps is not None and o.cooldown_steps > decay - o.warmup_steps:
        raise ConfigError(f"optimizer.cooldown_steps={o.cooldown_steps} is longer than the {decay - o.warmup_steps} "
                          f"steps between optimizer.warmup_steps={o.warmup_steps} and the end of the decay "
                          f"(optimizer.decay_steps or training.steps={decay})")
    if o.muon_lr is not None:
        _positive("optimizer.muon_lr", o.muon_lr)
    if o.muon_weight_decay is not None and o.muon_weight_decay < 0:
        raise ConfigError(f"optimizer.muon_weight_decay={o.muon_weight_decay} must be >= 0")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"optimizer.muon_momentum={o.muon_momentum} must be in [0, 1)")
    _positive("optimizer.muon_ns_steps", o.muon_ns_steps)
    for key in ("muon_rms", "qk_clip"):
        if getattr(o, key) < 0:
            raise ConfigError(f"optimizer.{key}={getattr(o, key)} must be >= 0 (0 = off)")
    for key in ("steps", "batch_size", "grad_accum", "eval_batches", "log_interval"):
        _positive(f"training.{key}", getattr(t, key))
    _positive("training.pipeline_repeats", t.pipeline_repeats)
    for key in ("eval_interval", "sample_tokens", "sample_top_k", "pipeline_microbatches"):
        if getattr(t, key) < 0:
            raise ConfigError(f"training.{key}={getattr(t, key)} must be >= 0")
    if t.sample_temperature < 0:
        raise ConfigError(f"training.sample_temperature={t.sample_temperature} must be >= 0")
    if t.max_consecutive_skips < 0:
        raise ConfigError(f"training.max_consecutive_skips={t.max_consecutive_skips} must be >= 0")
    if t.spike_threshold != 0 and not 1 < t.spike_threshold < math.inf:
        raise ConfigError(f"training.spike_threshold={t.spike_threshold} must be 0 (off) or a finite ratio > 1")
    if c.interval < 0:
        raise ConfigError(f"checkpoint.interval={c.interval} must be >= 0")
    _positive("checkpoint.keep", c.keep)
    if t.per_device_batch_size is not None and t.per_device_batch_size <= 0:
        raise ConfigError(f"training.per_device_batch_size={t.per_device_batch_size} must be > 0")


def _validate_grpo(cfg: Config) -> None:
    g, t = cfg.grpo, cfg.training
    for key in ("group_size", "max_completion_tokens", "iterations"):
        _positive(f"grpo.{key}", getattr(g, key))
    if g.temperature <= 0:
        raise ConfigError(f"grpo.temperature={g.temperature} must be > 0 (rollouts are sampled)")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"grpo.top_p={g.top_p} must be in (0, 1] (1 = off)")
    if g.top_k < 0:
        raise ConfigError(f"grpo.top_k={g.top_k} must be >= 0 (0 = off)")
    if g.beta < 0:
        raise ConfigError(f"grpo.beta={g.beta} must be >= 0 (0 = no reference model)")
    if not 0 < g.epsilon < 1:
        raise ConfigError(f"grpo.epsilon={g.epsilon} must be in (0, 1)")
    if g.epsilon_high is not None and g.epsilon_high <= 0:
        raise ConfigError(f"grpo.epsilon_high={g.epsilon_high} must be > 0 (or None: grpo.epsilon)")
    if g.log_completions < 0:
        raise ConfigError(f"grpo.log_completions={g.log_completions} must be >= 0 (0 = off)")
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


LORA_TARGETS = ("q", "k", "v", "o", "up", "gate", "down")


def _validate_lora(cfg: Config) -> None:
    lo = cfg.lora
    if lo.rank < 0:
        raise ConfigError(f"lora.rank={lo.rank} must be >= 0 (0 = off)")
    _positive("lora.alpha", lo.alpha)  # checked with or without a rank: a nonsensical value is a mistake either way
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout={lo.dropout} must be in [0, 1)")
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


PREFERENCE_OBJECTIVES = ("dpo", "ipo", "orpo")


def _validate_preference(cfg: Config) -> None:
    _positive("dpo.beta", cfg.dpo.beta)
    if not 0.0 <= cfg.dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={cfg.dpo.label_smoothing} must be in [0, 0.5) (the probability that "
                          "a preference label is wrong)")
    if cfg.orpo.lambda_ < 0:
        raise ConfigError(f"orpo.lambda={cfg.orpo.lambda_} must be >= 0")
    if cfg.training.objective in PREFERENCE_OBJECTIVES:
        if cfg.data.mixture:
            raise ConfigError(f"training.objective={cfg.training.objective} reads one preference dataset; "
                              "data.mixture is not supported with it (prepare the records together instead)")
        if cfg.data.loss_mask == "off":
            raise ConfigError(f"training.objective={cfg.training.objective} scores the replies, which the preference "
                              "data's loss mask marks; set data.loss_mask=auto")


def _validate_mesh_and_distributed(mesh: MeshConfig, d: DistributedConfig) -> None:
    for level in ("ici", "dcn"):
        fill = []
        for axis in MESH_AXES:
            v = getattr(mesh, f"{level}_{axis}")
            if v == 0 or v < -1:
                raise ConfigError(f"mesh.{level}_{axis}={v} must be a positive device count or -1 (fill)")
            if v == -1:
                fill.append(f"mesh.{level}_{axis}")
        if len(fill) > 1:
            raise ConfigError(f"{' and '.join(fill)} are all -1; at most one {level} axis may fill the remaining devices")
    if d.coordinator_address is not None and (d.num_processes is None or d.process_id is None):
        raise ConfigError("distributed.coordinator_address needs distributed.num_processes and distributed.process_id")
    if d.process_id is not None and d.process_id < 0:
        raise ConfigError(f"distributed.process_id={d.process_id} must be >= 0")
    if d.num_processes is not None and d.num_processes <= 0:
        raise ConfigError(f"distributed.num_processes={d.num_processes} must be > 0")
    if d.process_id is not None and d.num_processes is not None and not 0 <= d.process_id < d.num_processes:
        raise ConfigError(f"distributed.process_id={d.process_id} must be in [0, {d.num_processes})")


def _validate_diagnostics(cfg: Config) -> None:
    t = cfg.training
    dg, pr = cfg.diagnostics, cfg.profiler
    _positive("diagnostics.stack_trace_interval_seconds", dg.stack_trace_interval_seconds)
    if dg.hang_timeout_seconds < 0:
        raise ConfigError(f"diagnostics.hang_timeout_seconds={dg.hang_timeout_seconds} must be >= 0 (0 = off)")
    if dg.hang_exit and not dg.hang_timeout_seconds:
        raise ConfigError("diagnostics.hang_exit=true needs diagnostics.hang_timeout_seconds > 0")
    if pr.skip_steps < 0:
        raise ConfigError(f"profiler.skip_steps={pr.skip_steps} must be >= 0")
    _positive("profiler.steps", pr.steps)
    if (pr.mode == "xplane" or cfg.debug) and pr.skip_steps >= t.steps:
        raise ConfigError(f"profiler.skip_steps={pr.skip_steps} leaves no step to trace in training.steps={t.steps}; "
                          f"use at most {t.steps - 1}")
    if not 0 <= pr.port <= 65535:
        raise ConfigError(f"profiler.port={pr.port} must be a TCP port in 1-65535, or 0 (off)")
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
    model and 1 for the model's own multi-token prediction module (`mtp`).
    docs/generate.md: a draft model at batch 1 ran fastest at 3 proposals (against 2 and 4, two drafts); the
    module at 1 proposal had 0.86 of them kept and ran 1.3-1.5x; at 4, reused on its own output for the later
    proposals, 0.9-1.0x."""
    if d.draft_tokens is not None:
        return d.draft_tokens
    return 1 if mtp else 3


def validate_decode(d: DecodeConfig) -> None:
    if not (d.temperature >= 0 and math.isfinite(d.temperature)):
        raise ConfigError(f"decode.temperature={d.temperature} must be >= 0 (0 = greedy)")
    if d.top_k < 0:
        raise ConfigError(f"decode.top_k={d.top_k} must be >= 0 (0 = off)")
    if not 0 < d.top_p <= 1:
        raise ConfigError(f"decode.top_p={d.top_p} must be in (0, 1] (1 = off)")
    for key in ("max_new_tokens", "num_samples", "draft_tokens"):
        if getattr(d, key) is not None and getattr(d, key) <= 0:
            raise ConfigError(f"decode.{key}={getattr(d, key)} must be > 0")
    if d.draft and d.draft != "mtp" and not Path(d.draft).exists():
        raise ConfigError(f"decode.draft={d.draft} does not exist; give the draft model's run directory or "
                          "converted folder, or `mtp` for the model's own multi-token prediction module")
    if d.cache_length is not None and d.cache_length <= 0:
        raise ConfigError(f"decode.cache_length={d.cache_length} must be > 0 (or None)")
    stop_token_ids(d)


def validate_serve(s: ServeConfig) -> None:
    if not 1 <= s.port <= 65535:
        raise ConfigError(f"serve.port={s.port} must be in [1, 65535]")
    for key in ("max_slots", "max_queue", "prefill_chunk", "decode_steps", "replicas"):
        if getattr(s, key) < 1:
            raise ConfigError(f"serve.{key}={getattr(s, key)} must be >= 1")
    if s.max_slots % s.replicas:
        raise ConfigError(f"serve.max_slots={s.max_slots} must be a multiple of serve.replicas={s.replicas} "
                          "(each replica takes an equal share of the slots)")
    if s.prefix_cache < 0:
        raise ConfigError(f"serve.prefix_cache={s.prefix_cache} must be >= 0 (0 = off)")
    if s.page_size < 0:
        raise ConfigError(f"serve.page_size={s.page_size} must be >= 0 (0 = the slot cache)")
    if s.cache_gib < 0:
        raise ConfigError(f"serve.cache_gib={s.cache_gib} must be >= 0 (0 = automatic)")
    for key in ("max_body_mb", "max_header_kb", "header_timeout_s", "body_timeout_s"):
        if not getattr(s, key) > 0:
            raise ConfigError(f"serve.{key}={getattr(s, key)} must be > 0")
    for key in ("max_headers", "max_connections", "max_tokenize_chars"):
        if getattr(s, key) < 1:
            raise ConfigError(f"serve.{key}={getattr(s, key)} must be >= 1")
    if s.uds:
        validate_uds(s.uds)
    if s.api_key_file and not Path(s.api_key_file).is_file():
        raise ConfigError(f"serve.api_key_file={s.api_key_file} is not a file; give a file whose first line is the key")
    if s.chat_template and not Path(s.chat_template).is_file():
        raise ConfigError(f"serve.chat_template={s.chat_template} is not a file; give a Jinja chat template file")
    serve_adapters(s)


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
    if c.num_slices < 1:
        raise ConfigError(f"compile.num_slices={c.num_slices} must be >= 1")
    if c.max_batch_size < 1:
        raise ConfigError(f"compile.max_batch_size={c.max_batch_size} must be >= 1")
    if c.hbm_gib is not None and not (c.hbm_gib > 0 and math.isfinite(c.hbm_gib)):
        raise ConfigError(f"compile.hbm_gib={c.hbm_gib} must be > 0 (or None: the chip's HBM)")


def apply_parameter_scale(m: ModelConfig) -> ModelConfig:
    """Grow a model by `global_parameter_scale` (a power of 2) the way MaxText does: each doubling in turn
    doubles the heads and MLP width, then the width, then the layers, so the non-embedding parameters grow
    about in proportion. The head width stays fixed."""
    if m.global_parameter_scale == 1:
        return m
    base, rem = divmod(int(math.log2(m.global_parameter_scale)), 3)
    heads = base + (rem > 0)
    width = base + (rem > 1)
    return dataclasses.replace(
        m, n_heads=m.n_heads << heads, n_kv_heads=None if m.n_kv_heads is None else m.n_kv_heads << heads,
        d_model=m.d_model << width, head_dim=m.hd, d_ff=m.ff << heads, n_layers=m.n_layers << base,
        global_parameter_scale=1)


def to_json(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), indent=2)


def from_dict(d: dict) -> Config:
    return apply_overrides(Config(), flatten(d))
