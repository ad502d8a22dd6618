"""The model's settings (`model.*`): one frozen dataclass whose fields carry their help and range rules, the
same for every family (docs/families.md maps a family to its values), and the vision tower's (`model.vision`,
None for text-only models)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxlm.config.rules import ConfigError, Rule, at_least, between, positive, setting as _f

DType = Literal["float32", "bfloat16"]
ATTENTION_KINDS = ("global", "local", "chunked", "nope")
POWER_OF_2 = Rule(lambda v: v >= 1 and not v & (v - 1), "a power of 2 (1, 2, 4, ...)")
RematPolicy = Literal["none", "full", "minimal", "save_dots", "save_qkv_proj", "save_out_proj", "save_qkv_out_proj",
                      "save_attention", "offload_qkv_proj", "offload_attention", "offload_layer_inputs"]


def _ints(key: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise ConfigError(f"{key}={text!r} must be comma-separated whole numbers") from None
    if any(v < 0 for v in values):
        raise ConfigError(f"{key}={text!r} must be comma-separated whole numbers")
    return values


@dataclass(frozen=True)
class VisionConfig:
    """A ViT image encoder and its projector into the language model: Gemma 3's SigLIP tower (kind siglip),
    Llama 4's (kind llama4), Qwen2.5-VL's (kind qwen2_5: dynamic resolution, windowed attention, a 2x2 patch
    merger) or Qwen3-VL's (kind qwen3: learned interpolated positions, deepstack); docs/vision.md."""
    kind: Literal["siglip", "llama4", "qwen2_5", "qwen3"] = _f(
        "siglip", "the tower: siglip (Gemma 3: square images, pooled soft tokens, bidirectional image tokens), llama4 "
                  "(class token, 2D rotary, pixel shuffle and MLP adapter; images in tiles) or qwen2_5 (Qwen2.5-VL: "
                  "any size, merged patches, causal image tokens, M-RoPE) or qwen3 (Qwen3-VL: as qwen2_5 with "
                  "LayerNorm blocks, learned positions and deepstack)")
    image_size: int = _f(896, "side of the square images the encoder takes, in pixels", rule=positive())
    patch_size: int = _f(14, "side of one patch in pixels (image_size a multiple of it)", rule=positive())
    d_model: int = _f(1152, "width of the encoder", rule=positive())
    n_layers: int = _f(27, "encoder blocks", rule=positive())
    n_heads: int = _f(16, "attention heads of an encoder block (dividing d_model)", rule=positive())
    d_ff: int = _f(4304, "MLP hidden width of an encoder block", rule=positive())
    norm_eps: float = _f(1e-6, "epsilon of the encoder's LayerNorms and the projector's RMSNorm", rule=positive())
    activation: Literal["gelu", "gelu_tanh", "silu"] = _f("gelu_tanh", "MLP activation of the encoder blocks "
                                                                       "(qwen2_5: a gated MLP, silu)")
    tokens_per_image: int = _f(256, "soft tokens an image becomes: the patch grid average-pooled to a square of "
                                    "this many (a square number whose side divides the patches per side)",
                               rule=positive())
    image_token_id: int = _f(262144, "the token each soft token replaces in a prompt", rule=at_least(0))
    boi_token_id: int = _f(255999, "the token that opens an image in a prompt", rule=at_least(0))
    eoi_token_id: int = _f(256000, "the token that closes an image in a prompt", rule=at_least(0))
    rope_theta: float = _f(10000.0, "llama4: base of the encoder's 2D rotary over the patch grid", rule=positive())
    projector_dim: int = _f(4096, "llama4: width of the MLP adapter after the pixel shuffle", rule=positive())
    spatial_merge: int = _f(2, "qwen2_5: patches merged a side into one soft token", rule=positive())
    temporal_patch: int = _f(2, "qwen2_5: frames in one patch (a still image repeats its one frame)", rule=positive())
    window_size: int = _f(112, "qwen2_5: side in pixels of the windows of windowed-attention layers",
                          rule=positive())
    full_attention_layers: str = _f("", "qwen2_5: comma-separated encoder layers (from 0) attending over the whole "
                                        "image; the others attend within their window")
    mrope_section: str = _f("", "qwen2_5: the language model's rotary frequency pairs given to the temporal, height "
                                "and width positions of M-RoPE, comma-separated (summing to head_dim / 2)")
    mrope_interleaved: bool = _f(False, "qwen3: M-RoPE's frequency pairs assigned t, h, w, t, h, w, ... rather than in "
                                        "sections")
    position_embeddings: int = _f(2304, "qwen3: learned positions of the encoder, a square grid bilinearly "
                                        "resampled to each image's patch grid", rule=positive())
    deepstack_layers: str = _f("", "qwen3: comma-separated encoder layers (from 0) whose merged patches are added to "
                                   "the language model's image tokens after its first layers, one layer each")

    def __post_init__(self):
        if self.kind in ("qwen2_5", "qwen3"):
            self._check_qwen()
            return
        side = round(self.tokens_per_image ** 0.5)
        if self.image_size % self.patch_size:
            raise ConfigError(f"model.vision.patch_size={self.patch_size} must divide model.vision.image_size="
                              f"{self.image_size}")
        if side * side != self.tokens_per_image or self.patches_per_side % side:
            raise ConfigError(f"model.vision.tokens_per_image={self.tokens_per_image} must be the square of a divisor "
                              f"of the {self.patches_per_side} patches per side")
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.vision.n_heads={self.n_heads} must divide model.vision.d_model={self.d_model}")
        if self.kind == "llama4" and self.hd % 4:
            raise ConfigError(f"model.vision.kind='llama4' needs a head width (d_model / n_heads = {self.hd}) divisible "
                              "by 4: its rotary turns half the pairs by the patch's column, half by its row")

    def _check_qwen(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 4:
            raise ConfigError(f"model.vision.n_heads={self.n_heads} must divide model.vision.d_model={self.d_model} "
                              "into heads of a width divisible by 4 (2D rotary)")
        if self.kind == "qwen3":
            side = round(self.position_embeddings ** 0.5)
            if side * side != self.position_embeddings:
                raise ConfigError(f"model.vision.position_embeddings={self.position_embeddings} must be a square "
                                  "number (a square grid of learned positions)")
            if any(i >= self.n_layers for i in self.deepstack) or list(self.deepstack) != sorted(set(self.deepstack)):
                raise ConfigError(f"model.vision.deepstack_layers={self.deepstack_layers!r} must name encoder layers "
                                  f"(below {self.n_layers}) in increasing order")
        elif self.window_size % (self.patch_size * self.spatial_merge):
            raise ConfigError(f"model.vision.window_size={self.window_size} must be a multiple of patch_size x "
                              f"spatial_merge = {self.patch_size * self.spatial_merge}")
        if len(self.mrope) != 3:
            raise ConfigError(f"model.vision.mrope_section={self.mrope_section!r} must be three comma-separated "
                              "counts (temporal, height, width)")
        if any(i >= self.n_layers for i in self.full_layers):
            raise ConfigError(f"model.vision.full_attention_layers={self.full_attention_layers!r} names a layer past "
                              f"the {self.n_layers} encoder layers")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return _ints("model.vision.full_attention_layers", self.full_attention_layers)

    @property
    def deepstack(self) -> tuple[int, ...]:
        return _ints("model.vision.deepstack_layers", self.deepstack_layers)

    @property
    def mrope(self) -> tuple[int, ...]:
        return _ints("model.vision.mrope_section", self.mrope_section)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def hd(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int | None = _f(None, "vocabulary size; None takes it from the data's meta.json", rule=positive())
    block_size: int = _f(256, "context length in tokens", rule=positive())
    n_layers: int = _f(6, "number of transformer blocks", rule=positive())
    n_heads: int = _f(6, "query heads per block", rule=positive())
    n_kv_heads: int | None = _f(None, "key/value heads (grouped-query attention); None = n_heads", rule=positive())
    d_model: int = _f(384, "residual stream width", rule=positive())
    head_dim: int | None = _f(None, "width of one attention head; None = d_model / n_heads", rule=positive())
    d_ff: int | None = _f(None, "MLP hidden width; None = 4 * d_model", rule=positive())
    dropout: float = _f(0.0, "dropout rate on attention probabilities and residual branches", rule=between("[0, 1)"))
    bias: bool = _f(False, "biases in linear layers and LayerNorm")
    norm: Literal["rmsnorm", "layernorm"] = _f("rmsnorm", "normalization layer")
    norm_eps: float = _f(1e-5, "epsilon of the normalization layers", rule=positive())
    position: Literal["rotary", "learned"] = _f("rotary", "position encoding")
    rope_theta: float = _f(10000.0, "rotary embedding base", rule=positive())
    qk_norm: bool = _f(True, "normalize queries and keys per head before attention (QK-LayerNorm)")
    activation: Literal["gelu", "gelu_tanh", "silu", "relu"] = _f("gelu", "MLP activation")
    glu: bool = _f(False, "gated MLP (SwiGLU/GeGLU) instead of a plain two-layer MLP")
    tie_embeddings: bool = _f(True, "share the token embedding with the output projection")
    init_std: float = _f(0.02, "standard deviation of the normal weight initializer", rule=positive())
    param_dtype: DType = _f("float32", "dtype the weights are stored and updated in")
    compute_dtype: DType = _f("float32", "dtype of activations and matmul operands (softmax and loss stay float32)")
    remat: RematPolicy = _f("none", "activation rematerialization: none, full, minimal (save matmuls without a "
                                    "batch dim; under int8 training their bf16 results, not the int32 "
                                    "accumulators, and their int8 inputs), save_dots, save_qkv_proj / save_out_proj / save_qkv_out_proj / "
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
    attention_block: int = _f(512, "query and key tile length of blockwise and splash attention", rule=positive())
    splash_layout: Literal["head_dim_minor", "seq_minor"] = _f(
        "head_dim_minor",
        "how the splash kernel holds a head's queries, keys and values: head_dim_minor ([T, H] tiles) or seq_minor "
        "([H, T] tiles: heads narrower than the TPU's 128 lanes, GPT-2's 64, then reach the kernel by one "
        "transpose of the projections instead of copies through padded tiles; docs/performance.md)")
    context_parallel: Literal["ring", "all_gather"] = _f(
        "ring",
        "attention when the mesh splits the sequence (mesh.ici_sequence / dcn_sequence > 1): ring (key/value blocks "
        "passed around the sequence devices, blockwise tiles; memory 1/n per device) or all_gather (every device "
        "gathers all keys and values; one collective per layer); docs/scaling.md")
    mlp_chunk_tokens: int = _f(0, "run each layer's dense MLP (and its norms) over a longer sequence this many "
                                  "positions at a time, each chunk's [B, chunk, F] activations recomputed in the "
                                  "backward pass, so "
                                  "the [B, T, F] ones never exist at once (long context on one chip: the same "
                                  "result, about a quarter more MLP FLOPs under remat); used where it divides the "
                                  "sequence; 0 = all at once", rule=at_least(0, "0 = off"))
    loss_chunk_tokens: int = _f(512, "compute the output projection and cross-entropy of the training loss this "
                                     "many sequence positions at a time for longer sequences, recomputing each "
                                     "chunk's logits in the backward pass, so the [B, T, V] float32 logits never "
                                     "exist at once (the loss is the same); 0 = all at once",
                                rule=at_least(0, "0 = off"))
    scan_layers: bool = _f(True, "run the stacked layers with lax.scan (fast compile) instead of a Python loop")
    global_parameter_scale: int = _f(1, "multiply the non-embedding parameters by about this power of 2, "
                                        "growing width, heads, MLP width (and layers every third doubling)",
                                     rule=POWER_OF_2)
    # Family options (GPT-2, Llama, Mistral, Mixtral, Gemma, Gemma 2, Qwen): each is one named switch in the one
    # forward pass; docs/families.md maps every family to its values.
    qkv_bias: bool = _f(False, "biases on the query/key/value projections only (Qwen 2); `bias` turns on every bias")
    norm_plus_one: bool = _f(False, "RMSNorm multiplies by (1 + scale) with scale initialized to 0 (Gemma)")
    embed_scale: bool = _f(False, "multiply token embeddings by sqrt(d_model) (Gemma)")
    post_norms: bool = _f(False, "also normalize each block's attention and MLP output before the residual add (Gemma 2)")
    attn_scale: float | None = _f(None, "attention logits are multiplied by attn_scale ** -0.5; None = head_dim "
                                        "(Gemma 2 query_pre_attn_scalar)", rule=positive())
    attn_logit_softcap: float | None = _f(None, "cap * tanh(logits / cap) on attention logits; None = off "
                                                "(Gemma 2: 50)", rule=positive())
    final_logit_softcap: float | None = _f(None, "cap * tanh(logits / cap) on output logits; None = off (Gemma 2: 30)",
                                           rule=positive())
    sliding_window: int | None = _f(None, "keys a `local` layer attends to, itself included (Mistral, Gemma 2)",
                                    rule=positive())
    layer_pattern: str = _f("global", "comma-separated attention kinds repeated over the layers: global, local "
                            "(the last model.sliding_window positions), chunked (positions of the same "
                            "model.attention_chunk block, Llama 4), nope (global without rotary embeddings, "
                            "Llama 4), e.g. local,global for Gemma 2; layers are scanned in groups of this length "
                            "(a last group shorter than the pattern runs unrolled, as Gemma 3's 26 layers of 6)")
    attention_chunk: int | None = _f(None, "positions of one block of `chunked` layers (Llama 4: 8192)",
                                     rule=positive())
    local_rope_theta: float | None = _f(None, "rotary base of `local` layers, which then rotate without "
                                              "model.rope_scaling (Gemma 3: 10000); None = as global layers",
                                        rule=positive())
    rope_scaling: Literal["none", "llama3", "linear", "yarn"] = _f(
        "none", "rotary frequency scaling for long context: llama3 (Llama 3.1), linear (positions divided by "
                "rope_scaling_factor, Gemma 3's global layers), yarn (gpt-oss, DeepSeek-V3)")
    rope_scaling_factor: float = _f(8.0, "llama3/linear/yarn rope scaling: the context extension factor",
                                    rule=positive())
    rope_low_freq_factor: float = _f(1.0, "llama3 rope scaling: low_freq_factor")
    rope_high_freq_factor: float = _f(4.0, "llama3 rope scaling: high_freq_factor")
    rope_original_context: int = _f(8192, "llama3/yarn rope scaling: context length the model was pretrained with",
                                    rule=positive())
    rope_yarn_beta_fast: float = _f(32.0, "yarn rope scaling: beta_fast (rotations below which frequencies are "
                                          "interpolated)", rule=positive())
    rope_yarn_beta_slow: float = _f(1.0, "yarn rope scaling: beta_slow", rule=positive())
    rope_yarn_truncate: bool = _f(True, "yarn rope scaling: round the correction range to whole dimensions")
    rope_yarn_mscale: float = _f(0.0, "yarn rope scaling: mscale (with mscale_all_dim, the rotary attention "
                                      "factor is their ratio); 0 = unset", rule=at_least(0))
    rope_yarn_mscale_all_dim: float = _f(0.0, "yarn rope scaling: mscale_all_dim; also multiplies the attention "
                                              "scale by (0.1 * mscale_all_dim * ln(factor) + 1)^2, as DeepSeek-V3 "
                                              "does; 0 = unset", rule=at_least(0))
    rope_attention_factor: float | None = _f(None, "yarn rope scaling: factor on the rotated queries and keys; "
                                                   "None = from the factor and mscales", rule=positive())
    attn_out_bias: bool = _f(False, "a bias on the attention output projection (gpt-oss, with qkv_bias)")
    attn_sinks: bool = _f(False, "a learned logit per query head in every softmax denominator (gpt-oss)")
    qk_l2_norm: bool = _f(False, "queries and keys divided by their root mean square (no learned scale) after "
                                 "rotary, on layers with rotary (Llama 4's use_qk_norm)")
    attn_temperature_tuning: bool = _f(False, "on `nope` layers, queries multiplied by "
                                              "1 + attn_temperature_scale * ln(1 + floor((position + 1) / "
                                              "attn_temperature_floor)) (Llama 4)")
    attn_temperature_floor: int = _f(8192, "attention temperature tuning: floor_scale", rule=positive())
    attn_temperature_scale: float = _f(0.1, "attention temperature tuning: attn_scale", rule=positive())
    kv_lora_rank: int = _f(0, "multi-head latent attention (DeepSeek-V2/V3): width of the compressed key/value "
                              "latent that the KV cache stores; 0 = ordinary attention", rule=at_least(0))
    q_lora_rank: int = _f(0, "latent attention: width of the compressed query; 0 = a full-rank query projection",
                          rule=at_least(0))
    qk_nope_head_dim: int = _f(0, "latent attention: per-head query/key width without rotary", rule=at_least(0))
    qk_rope_head_dim: int = _f(0, "latent attention: width of the rotary query part and of the rotary key shared "
                                  "by all heads", rule=at_least(0))
    v_head_dim: int = _f(0, "latent attention: per-head value width", rule=at_least(0))
    n_experts: int = _f(0, "experts per mixture-of-experts MLP; 0 = dense MLP (Mixtral: 8)",
                        rule=at_least(0, "0 = dense MLP"))
    experts_per_token: int = _f(2, "experts each token is routed to (top-k)")
    expert_capacity_factor: float = _f(
        0.0, "with experts split over devices (mesh expert axis > 1): token copies each device sends an expert, as "
        "a multiple of an even share (copies / n_experts); the overflow is dropped and its weight left to the "
        "residual. 0 = dropless (buffers sized for the worst case)", rule=at_least(0, "0 = dropless"))
    expert_all_to_all: Literal["auto", "ragged", "padded"] = _f(
        "auto", "how expert-parallel token copies travel: ragged (jax.lax.ragged_all_to_all: only the filled rows; "
        "TPU), padded (all_to_all of whole buffers; any platform), auto = ragged on TPU except v5e, whose pod "
        "slices XLA:TPU does not compile it for")
    moe_matmul: Literal["auto", "ragged_dot", "megablox"] = _f(
        "auto", "the experts' grouped matmul: ragged_dot (jax.lax.ragged_dot, any platform), megablox (JAX's Pallas "
        "grouped-matmul kernel for TPU; interpreted, slowly, elsewhere), auto = megablox on a TPU (1.1-1.2x "
        "ragged_dot on a v5e, docs/performance.md), ragged_dot elsewhere")
    moe_tiles: str = _f(
        "", "megablox's largest tiles, rows,contracted,out (three multiples of 128, e.g. 512,1024,1024) for every "
        "grouped matmul of the step (forward, and the backward's gmm and tgmm; a width below its tile is one "
        "tile); '' = model/layers.py's MEGABLOX_TILES. Only the kernel's speed and VMEM use depend on it")
    router_aux_loss_coef: float = _f(0.02, "weight of the load-balancing loss added to the training loss",
                                     rule=at_least(0))
    expert_d_ff: int | None = _f(None, "hidden width of each expert (and, times n_shared_experts, of the shared "
                                       "expert); None = d_ff (Qwen3-MoE, DeepSeek-V3 and Llama 4 differ)",
                                 rule=positive())
    first_dense_layers: int = _f(0, "with experts: the first this many layers have a dense MLP of width d_ff "
                                    "(DeepSeek-V3's first_k_dense_replace)", rule=at_least(0))
    moe_layer_interval: int = _f(1, "with experts: layer i (from 0) has experts when (i + 1) is a multiple of this, "
                                    "the others a dense MLP of width d_ff (Llama 4's interleave_moe_layer_step)",
                                 rule=positive())
    n_shared_experts: int = _f(0, "shared experts every token goes through besides its routed ones, one MLP of "
                                  "width n_shared_experts * expert_d_ff (DeepSeek-V3, Llama 4)", rule=at_least(0))
    router_score: Literal["softmax", "sigmoid"] = _f(
        "softmax", "router scores: softmax over the experts (Mixtral, Qwen3-MoE, gpt-oss) or a sigmoid per expert "
                   "(DeepSeek-V3, Llama 4)")
    router_norm_topk: bool = _f(True, "the chosen experts' weights are their scores divided by the chosen scores' "
                                      "sum (Qwen3-MoE's norm_topk_prob); false = the scores themselves")
    router_scale: float = _f(1.0, "the chosen experts' weights are multiplied by this (DeepSeek-V3's "
                                  "routed_scaling_factor)", rule=positive())
    router_groups: int = _f(1, "group-limited routing: the experts form this many groups, and a token picks its "
                               "experts from the router_topk_groups groups whose two best scores sum highest "
                               "(DeepSeek-V3's n_group)", rule=positive())
    router_topk_groups: int = _f(1, "group-limited routing: groups a token picks from (DeepSeek-V3's topk_group)",
                                 rule=positive())
    router_bias: bool = _f(False, "a bias on the router logits (gpt-oss)")
    router_balance_bias: bool = _f(False, "a per-expert bias added to the scores for choosing experts only (not "
                                          "to their weights), moved towards balanced loads outside the gradient: "
                                          "DeepSeek-V3's auxiliary-loss-free balancing (e_score_correction_bias)")
    moe_bias_update_rate: float = _f(0.001, "with router_balance_bias: each step the bias of an expert that got "
                                            "more than the mean load falls by this, one that got less rises by "
                                            "this (DeepSeek-V3's gamma); 0 = frozen (fine-tuning)", rule=at_least(0))
    router_weights_input: bool = _f(False, "the routing weight multiplies an expert's input instead of its output "
                                           "(Llama 4)")
    expert_bias: bool = _f(False, "biases on the experts' projections (gpt-oss)")
    swiglu_limit: float | None = _f(None, "gpt-oss's clamped SwiGLU: gate clipped to <= limit, up to [-limit, "
                                          "limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate); None = "
                                          "the plain gated MLP", rule=positive())
    swiglu_alpha: float = _f(1.702, "clamped SwiGLU: the sigmoid's slope", rule=positive())
    mtp_layers: int = _f(0, "multi-token prediction modules (DeepSeek-V3's num_nextn_predict_layers): module k "
                            "predicts the token k + 1 positions ahead from the previous depth's hidden state and "
                            "the embedding of the token k positions ahead", rule=at_least(0))
    mtp_loss_weight: float = _f(0.3, "weight of the mean multi-token prediction loss added to the training loss",
                                rule=at_least(0))
    quantization: Literal["none", "int8", "fp8", "int8_weights"] = _f(
        "none",
        "matmul quantization: int8 (int8 x int8 -> int32 forward and backward), fp8 (e4m3 forward, e5m2 "
        "gradients; NVIDIA compute capability 8.9+), int8_weights (inference: weights stored in int8)",
    )
    quant_logits: bool = _f(False, "also quantize the output (logits) projection")
    quant_stochastic_rounding: bool = _f(True, "round int8 gradients stochastically (unbiased) instead of to nearest")
    vision: VisionConfig | None = _f(None, "the vision tower and projector of a vision-language model (Gemma 3); "
                                           "None = text only")

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
    def megablox_tiles(self) -> tuple[int, int, int] | None:
        """model.moe_tiles as (rows, contracted, out), None where unset (the kernel's default tiles)."""
        if not self.moe_tiles.strip():
            return None
        try:
            tiles = _ints("model.moe_tiles", self.moe_tiles)
        except ConfigError:
            tiles = ()
        if len(tiles) != 3 or any(t < 128 or t % 128 for t in tiles):
            raise ConfigError(f"model.moe_tiles={self.moe_tiles!r} must be three multiples of 128 (rows, contracted, "
                              "out), e.g. 512,1024,1024; '' = the default tiles")
        return tiles

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
