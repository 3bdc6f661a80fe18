"""A tiny Qwen3-MoE checkpoint with its own tokenizer, built offline.

For tests and local runs without a model download: 4 decoder layers (layer 0
dense, layers 1-3 MoE with 8 experts, top-2), hidden size 128, vocabulary 512,
float32, random weights, and a byte-level BPE tokenizer trained on a small
built-in corpus. The same seed gives byte-identical files.

Usage::

    python -m routereplay.tiny_model OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# Router weights get this standard deviation (the default init is 0.02): the
# router logits then spread by several units, so top-k choices are far from
# ties and float32 engines agree exactly.
ROUTER_STD = 0.5

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes
each token to a few experts out of many. The router scores every expert and
keeps the top k of them; the chosen experts process the token and their outputs
are summed with the router's weights. Reinforcement learning samples rollouts
from an inference engine and trains the policy on them. When the engine and the
trainer pick different experts for the same token, the trainer optimises a
policy that did not produce the samples. Router replay records the experts that
the engine chose and makes the trainer use them again.
Once upon a time there was a small model that lived on a laptop. It had four
layers, eight experts and a vocabulary of five hundred and twelve tokens. Every
morning it read the same story and every evening it wrote a new one.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024.
Questions and answers. What is two plus two? Four. What colour is the sky? Blue.
"""


@dataclass(frozen=True)
class MoESize:
    """Sizes of a generated Qwen3-MoE (layer 0 is dense, the others MoE).

    The defaults are the tiny test model; ``BENCH_SIZE`` is large enough for timings to mean
    something on a CPU.
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention kernel needs head_dim >= 32
    num_experts: int = 8
    num_experts_per_tok: int = 2


TINY_SIZE = MoESize()
BENCH_SIZE = MoESize(
    hidden_size=1024,
    intermediate_size=1024,
    moe_intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
)


def build_tokenizer():
    """Train the byte-level BPE tokenizer on the built-in corpus.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with ``eos_token`` and
        ``pad_token`` set; its vocabulary has at most ``VOCAB_SIZE`` entries.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def build_tiny_model(out_dir: str | Path, seed: int = 0, size: MoESize = TINY_SIZE) -> Path:
    """Write a random-init Qwen3-MoE model and its tokenizer to ``out_dir``.

    Args:
        out_dir: Folder to create or overwrite.
        seed: Seed of the random weights; the same seed gives identical files.
        size: The model's sizes; the tiny test model by default.

    Returns:
        ``out_dir`` as a ``Path``, ready for ``from_pretrained`` or vLLM.
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        **asdict(size),
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, ROUTER_STD)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
