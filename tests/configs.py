"""Small litgpt configurations of the families we test: real block structure, tiny sizes."""

from thunder_fsdp_mem.training.litgpt_models import ModelSpec

NEOX = ModelSpec(  # GPT-NeoX-style parallel residual, LayerNorm, GELU MLP, partial rotary
    name="stablecode-completion-alpha-3b",
    n_layers=2,
    block_size=64,
    overrides=(("n_embd", 128), ("n_head", 4), ("padded_vocab_size", 256), ("intermediate_size", 512)),
)
LLAMA = ModelSpec(  # Llama-style: RMSNorm, SwiGLU (LLaMAMLP), grouped-query attention
    name="Llama-3-8B",
    n_layers=2,
    block_size=64,
    overrides=(
        ("n_embd", 128),
        ("n_head", 8),
        ("n_query_groups", 2),
        ("padded_vocab_size", 256),
        ("intermediate_size", 384),
    ),
)
GEMMA = ModelSpec(  # Gemma-style: GemmaMLP (GELU-tanh gate), scaled embeddings, RMSNorm with unit offset
    name="gemma-2b",
    n_layers=2,
    block_size=64,
    overrides=(
        ("n_embd", 128),
        ("n_head", 4),
        ("n_query_groups", 1),
        ("head_size", 32),
        ("padded_vocab_size", 256),
        ("intermediate_size", 384),
    ),
)
BY_NAME = {"neox": NEOX, "llama": LLAMA, "gemma": GEMMA}
SOFTCAP_TIED = ModelSpec(  # gemma-2-style: soft-capped logits, the embedding's weight tied to the head's
    name="gemma-2-2b",
    n_layers=1,
    block_size=128,
    overrides=(
        ("n_embd", 64),
        ("n_head", 2),
        ("head_size", 32),
        ("intermediate_size", 128),
        ("n_query_groups", 1),
        ("padded_vocab_size", 512),
        ("vocab_size", 500),
    ),
)
