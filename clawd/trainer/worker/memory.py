"""The trainer's memory plan: bytes per rank for a model's shape and `[train]`, before anything loads
(docs/ARCHITECTURE.md §13). Pure, no torch: `bin/clawd --check-config` and `--plan` print it, and refuse a
layout whose total passes `[train.world] gpu_memory_gib` (its `memory_fraction` share).

What a rank holds, for a Llama/Qwen-style decoder of N parameters over W ranks (FSDP2 shards what is
trained, its gradients and AdamW's two moments; float32 masters):
- full fine-tune: parameters 4N/W, gradients 4N/W, optimizer 8N/W, plus on CUDA two layers gathered in
  bf16 at a time (the one computing and the one prefetched);
- LoRA: the frozen base (bf16 on CUDA, float32 on CPU) /W and the adapters' 16 bytes a parameter /W;
- activations at `micro_batch_tokens`, per token and decoder layer, measured with torch's saved-tensor
  hooks (`recompute.saved_bytes`) on Qwen2 shapes whose hidden, intermediate and key-value sizes were
  varied one at a time (`tests/test_memory_plan.py` measures them again): float32 (CPU) 32h + 16i + 8kv
  bytes, bf16 autocast (CUDA) 30h + 8i + 4kv (the residual stream and the norms stay float32). The bf16
  figure gives 1.6 MB a token for Qwen2.5-0.5B's 24 layers, where bench/gpu.py measured ~1.7 MB on an
  H200 (the allocator's view, workspaces included). With recompute a layer keeps only its float32 input (4h a token) and one layer's activations exist
  at a time in the backward; the embeddings and the final norm add 8h;
- the output layer's chunk: at most 2^28 logits (`head.HEAD_CHUNK_ELEMENTS`), float32, and its gradient.
Estimates, not an allocator's peak: kernels' workspaces and the allocator's fragmentation come on top,
hence the margin the check keeps.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

HEAD_CHUNK_ELEMENTS = 1 << 28   # logits per output-layer chunk (clawd.trainer.worker.head): 1 GiB a float32 buffer
MARGIN = 0.9                    # the plan must fit in this share of the memory it is checked against
GIB = 1 << 30


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model's config.json."""
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool
    qkv_bias: bool = True  # Qwen2's q, k and v projections have biases; Llama's do not (attention_bias)

    @classmethod
    def from_config(cls, config: dict) -> "Shape":
        text = config.get("text_config", config)  # multimodal configs nest the language model's
        heads = int(text["num_attention_heads"])
        return cls(vocab=int(text["vocab_size"]), hidden=int(text["hidden_size"]),
                   intermediate=int(text["intermediate_size"]), layers=int(text["num_hidden_layers"]),
                   heads=heads, kv_heads=int(text.get("num_key_value_heads") or heads),
                   tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                   qkv_bias=bool(text.get("attention_bias", text.get("model_type") == "qwen2")))

    @property
    def kv(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def layer_parameters(self) -> int:
        h, i, kv = self.hidden, self.intermediate, self.kv
        bias = (h + 2 * kv) if self.qkv_bias else 0
        return h * h * 2 + h * kv * 2 + bias + 3 * h * i + 2 * h  # q, o; k, v; biases; the MLP; two norms

    @property
    def parameters(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.layers * self.layer_parameters + self.hidden

    def lora_parameters(self, rank: int, targets: tuple[str, ...]) -> int:
        h, i, kv = self.hidden, self.intermediate, self.kv
        dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return self.layers * sum(rank * (a + b) for t, (a, b) in dims.items() if t in targets)


def activation_bytes_per_token_layer(shape: Shape, cuda: bool) -> int:
    h, i, kv = shape.hidden, shape.intermediate, shape.kv
    return 30 * h + 8 * i + 4 * kv if cuda else 32 * h + 16 * i + 8 * kv


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one rank needs; `activations` at the configured recompute, `activations_other` at the other."""
    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    activations_other: int
    head: int
    recompute: bool
    micro_batch_tokens: int
    world_size: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations + self.head

    def as_json(self) -> dict:
        return {**asdict(self), "total": self.total}


def plan(shape: Shape, train, cuda: bool, recompute: bool) -> MemoryPlan:
    """`train`: a TrainConfig (its world size, micro_batch_tokens, LoRA settings)."""
    w, tokens = train.world.size, train.micro_batch_tokens
    n = shape.parameters
    if train.lora.enabled:
        lora = shape.lora_parameters(train.lora.rank, train.lora.target_modules)
        params = n * (2 if cuda else 4) // w + 4 * lora // w
        grads, optim = 4 * lora // w, 8 * lora // w
    else:
        params, grads, optim = 4 * n // w, 4 * n // w, 8 * n // w
    gathered = 2 * 2 * shape.layer_parameters if cuda and w > 1 else 0
    per_layer = activation_bytes_per_token_layer(shape, cuda)
    full = tokens * (shape.layers * per_layer + 8 * shape.hidden)
    redone = tokens * (shape.layers * 4 * shape.hidden + 8 * shape.hidden + per_layer)
    head = 2 * 4 * min(HEAD_CHUNK_ELEMENTS, tokens * shape.vocab)  # the chunk's logits and their gradient
    return MemoryPlan(params, grads, optim, gathered, redone if recompute else full, full if recompute else redone,
                      head, recompute, tokens, w)


def problem(memory: MemoryPlan, gpu_memory_gib: float, memory_fraction: float) -> str | None:
    """Why the plan cannot fit one GPU of `gpu_memory_gib` (its `memory_fraction` share), or None."""
    if gpu_memory_gib <= 0:
        return None
    room = gpu_memory_gib * GIB * (memory_fraction or 1.0) * MARGIN
    if memory.total <= room:
        return None
    hint = ("turn recompute on, " if not memory.recompute and memory.activations_other < memory.activations else "")
    return (f"the trainer needs about {memory.total / GIB:.1f} GiB a rank, more than {MARGIN:.0%} of the "
            f"{room / MARGIN / GIB:.1f} GiB it may use: {hint}lower micro_batch_tokens, train LoRA, or add ranks")


def describe(memory: MemoryPlan) -> str:
    """Lines for `--check-config` and `--plan`."""
    g = lambda b: f"{b / GIB:.2f} GiB"
    other = "without" if memory.recompute else "with"
    return (f"trainer memory per rank ({memory.world_size} rank(s), micro_batch_tokens {memory.micro_batch_tokens}, "
            f"recompute {'on' if memory.recompute else 'off'}): parameters {g(memory.parameters)}, gradients "
            f"{g(memory.gradients)}, optimizer {g(memory.optimizer)}, gathered layers {g(memory.gathered)}, "
            f"activations {g(memory.activations)} ({other} recompute {g(memory.activations_other)}), output-layer "
            f"chunk {g(memory.head)}; about {g(memory.total)} in all")
