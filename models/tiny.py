"""A tiny causal LM built from a config, with a byte-level tokenizer: for tests and the smoke campaign.

Nothing is downloaded: the tokenizer maps the 256 bytes plus the ChatML markers to ids, and the model
is a two-layer Llama with about a hundred thousand parameters, initialized from a fixed seed. Its
attention heads are 32 wide (hidden 64, two heads): every rollout backend runs it, vLLM's CPU attention
included, which has no kernels for heads narrower than 32.
"""

from __future__ import annotations

from pathlib import Path

from evertrain.models.folders import publish_folder

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer() -> object:
    """A byte-level tokenizer with ChatML special tokens; vocabulary of 259."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, chat_template=CHATML)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = "<|im_end|>", "<|im_end|>", None
    return tokenizer


HEAD_SIZE = 32  # the narrowest vLLM's CPU attention kernels accept


def build_tiny_model(dest: Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int | None = None) -> Path:
    """Write a tiny Llama and its tokenizer to ``dest`` (idempotent: an existing folder is kept as it is).

    ``heads`` defaults to ``hidden // 32`` (heads 32 wide); key-value heads are half of them (at least one).
    """
    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = heads or max(1, hidden // HEAD_SIZE)
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not a multiple of {heads} attention heads")
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return publish_folder(dest, write, lambda folder: (folder / "config.json").exists())
