"""A tiny MoE checkpoint with its own tokenizer, built offline.

For tests and local runs without a model download: 4 decoder layers, hidden
size 128, vocabulary 512, float32, random weights, and a byte-level BPE
tokenizer trained on a small built-in corpus. The same seed gives byte-identical
files. One family per ``model_type``: its module in ``routereplay.families`` gives the
tiny model's config and sizes (the default, ``qwen3_moe``: layer 0 dense, layers 1-3 MoE with
8 experts, top-2, qk-norm, ``norm_topk_prob``).

``--realistic-margins`` narrows the routers' top-k margins to a trained model's
(``REALISTIC_ROUTER_SPREAD``); by default they are wide, so float32 engines agree exactly.

Usage::

    python -m routereplay.dev.tiny_model OUT_DIR [--seed N] [--family qwen3_moe]
        [--realistic-margins]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from routereplay.families import DEFAULT_FAMILY, FAMILIES
from routereplay.families.base import VOCAB_SIZE, MoESize

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# Router weights get this standard deviation (the default init is 0.02): the
# router logits then spread by several units, so top-k choices are far from
# ties and float32 engines agree exactly.
ROUTER_STD = 0.5
# REALISTIC_ROUTER_SPREAD: routers whose top-k margins are as narrow as a trained model's.
# Target: a bf16 forward and a float32 forward choose different experts on about 10% of
# tokens per MoE layer, as the R3 work reports for Qwen3-30B-A3B (trained routers put the k-th
# and (k+1)-th experts close). Measured with transformers on the tiny Qwen3-MoE (8 x 64
# random tokens): spread 0.03 gives 88-90% agreement per layer, the k-th minus (k+1)-th
# router probability a median of 0.008 (10th percentile 0.001, 90th 0.022); independent rows
# (the default) give 99% and a median of 0.038 (90th percentile 0.31).
REALISTIC_ROUTER_SPREAD = 0.03
# The selection-only expert bias of sigmoid routers (GLM-4.5, DeepSeek-V3): sigmoid scores
# lie in (0, 1), so a bias of this spread changes some of the top-k choices.
EXPERT_BIAS_STD = 0.1

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


def _narrow_margins(weight, spread: float) -> None:
    """Router ``weight`` ``[experts, hidden]`` -> shared row + ``spread`` x its own deviation.

    The shared part adds the same amount to every expert's logit, so it leaves the choice
    alone but sets the logits' magnitude, hence their rounding error in bf16; the experts'
    differences, hence the top-k margins, shrink by ``spread`` relative to it. (Scaling all
    rows alike would not do: the margins and the rounding error scale together.)
    """
    mean = weight.mean(0, keepdim=True)
    shared = mean * weight.shape[0] ** 0.5  # the mean of E normal rows, rescaled to one row's std
    weight.sub_(mean).mul_(spread).add_(shared)


def family_config(family: str, size: MoESize | None, token_ids: dict[str, int]):
    """The transformers config of a tiny ``family`` model.

    Args:
        family: One of ``FAMILIES`` (a Hugging Face ``model_type``).
        size: The sizes; None for the family's tiny test size.
        token_ids: ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``.

    Returns:
        A ``transformers.PretrainedConfig`` of that family.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {tuple(FAMILIES)}")
    spec = FAMILIES[family]
    return spec.tiny_config(size or spec.tiny_size, token_ids)


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    size: MoESize | None = None,
    family: str = DEFAULT_FAMILY,
    router_std: float = ROUTER_STD,
    router_spread: float | None = None,
) -> Path:
    """Write a random-init MoE model of ``family`` and its tokenizer to ``out_dir``.

    Args:
        out_dir: Folder to create or overwrite.
        seed: Seed of the random weights; the same seed gives identical files.
        size: The model's sizes; the family's tiny test model when None.
        family: The Hugging Face ``model_type``, one of ``FAMILIES``.
        router_std: Standard deviation of the router weights: ``ROUTER_STD`` (wide margins,
            engines agree exactly).
        router_spread: None keeps the routers' rows independent (wide margins). A value in
            (0, 1] gives every expert's row a shared part plus ``router_spread`` times its own
            (``REALISTIC_ROUTER_SPREAD``: margins as narrow as a trained model's, see
            docs/trainer.md).

    Returns:
        ``out_dir`` as a ``Path``, ready for ``from_pretrained`` or vLLM.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    token_ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    config = family_config(family, size, token_ids)
    spec = FAMILIES[family]
    router = f"mlp.{spec.weights.router}.weight"
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(router):
                    param.normal_(0.0, router_std)
                    if router_spread is not None:
                        _narrow_margins(param, router_spread)
            for name, buffer in model.named_buffers():
                # Zero by default; a random bias makes biased selection differ from the
                # unbiased scores, so replay that mixes them up fails the tests.
                if name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, EXPERT_BIAS_STD)
            if spec.tiny_init is not None:
                spec.tiny_init(model)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _add_mtp_layers(out, config, seed)
    _share(out)
    return out


def _share(out: Path) -> None:
    """Make the model readable by every user: safetensors writes its files 0600, so a model
    built by root (an image's build step) could not be loaded by the uid that serves it."""
    for path in (out, *out.rglob("*")):
        extra = 0o555 if path.is_dir() else 0o444
        path.chmod(path.stat().st_mode | extra)


def _add_mtp_layers(out: Path, config, seed: int) -> None:
    """Write the multi-token-prediction layers DeepSeek-V3 and GLM-4.5 checkpoints have after
    their decoder layers, which transformers neither builds nor saves: ``model.layers.{N + i}``
    with the names both use (a decoder layer's tensors plus ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm``, ``shared_head.head`` and ``embed_tokens``; some later GLM releases
    leave the last two out, vLLM then shares ``lm_head`` and the embedding). Random, from ``seed``:
    the last decoder layer's tensors plus noise (std 0.01), so that a router reading them in
    place of a decoder layer's routes differently."""
    import torch
    from safetensors.torch import load_file, save_file

    count = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if not count:
        return
    path = out / "model.safetensors"
    state = load_file(str(path))
    last, hidden = config.num_hidden_layers - 1, config.hidden_size
    generator = torch.Generator().manual_seed(seed + 1)
    template = {
        name[len(f"model.layers.{last}.") :]: t
        for name, t in state.items()
        if name.startswith(f"model.layers.{last}.")
    }
    for i in range(count):
        prefix = f"model.layers.{config.num_hidden_layers + i}."
        for name, t in template.items():
            state[prefix + name] = t + 0.01 * torch.randn(t.shape, generator=generator)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            state[f"{prefix}{norm}.weight"] = torch.ones(hidden)
        eh_proj = torch.randn(hidden, 2 * hidden, generator=generator)
        state[prefix + "eh_proj.weight"] = 0.02 * eh_proj
        state[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
        state[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(path), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=tuple(FAMILIES), default=DEFAULT_FAMILY)
    parser.add_argument(
        "--realistic-margins",
        action="store_true",
        help=f"narrow router margins (router spread {REALISTIC_ROUTER_SPREAD})",
    )
    args = parser.parse_args(argv)
    spread = REALISTIC_ROUTER_SPREAD if args.realistic_margins else None
    print(build_tiny_model(args.out_dir, args.seed, family=args.family, router_spread=spread))


if __name__ == "__main__":
    main()
