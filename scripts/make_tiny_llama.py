"""Build a small random-weight Llama with a word-level tokenizer, saved so `transformers serve` loads it
from a local path with no hub access (HF_HUB_OFFLINE=1).

Why: a real engine run needs a real model on a machine that reaches no model hub. The weights are
random (the text is nonsense) but the shapes, the decode loop and the server around it are real:

    python scripts/make_tiny_llama.py OUT_DIR [--layers 8 --hidden 1024 --vocab 4096 --random-state 0]
    python scripts/make_tiny_llama.py OUT_DIR --layers 2 --hidden 256      # seconds on a CPU

The tokenizer is a WordLevel vocabulary (special tokens, common words, then filler words `w<N>` up
to --vocab) split on whitespace and punctuation, so a prompt of N common words is N tokens. It has a
chat template, so /v1/chat/completions works too. The model's generation config names no EOS token:
random weights would otherwise stop at an unpredictable step, and `transformers serve` has no
`ignore_eos` (an unknown request field is a 422), so every request decodes exactly `max_tokens`.
Needs torch, transformers >= 5 and tokenizers; uses nothing newer than transformers 5.17 / torch 2.11.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PUNCTUATION = list(".,;:!?'\"()-")
# The benchmark client's synthetic prompt words come first, so its prompts never hit <unk>.
WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be or "
         "has had not but what all when there can more one about some time a i you he she we they me "
         "him her us them my your our their who whom whose where why how if then than so no yes do "
         "does did done have having will would shall should may might must could up down out over "
         "under again new old good bad first last long great little own other right big high small "
         "large next early young important few public same able day year way man woman child world "
         "life hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot study book eye job word "
         "business issue side kind head house service friend father power hour game line end member "
         "law car city community name president team minute idea kid body information back parent "
         "face others level office door health person art war history party result change morning "
         "reason research girl guy moment air teacher force education paris france capital hello").split()

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' <|end|> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


def vocabulary(size: int) -> list[str]:
    """Specials, punctuation, common words, then filler words to reach `size` entries."""
    base = list(dict.fromkeys(SPECIALS + PUNCTUATION + WORDS))
    if size < len(base):
        raise ValueError(f"--vocab must be at least {len(base)}")
    return base + [f"w{i}" for i in range(size - len(base))]


def build_tokenizer(size: int):
    """A fast tokenizer built with `tokenizers` alone (no download), wrapped for save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(vocabulary(size))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                  pre_tokenizers.Punctuation()])
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, as WordLevel needs
    core.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=SPECIALS[4:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_bpe_tokenizer(size: int):
    """A byte-level BPE tokenizer trained here on the word list: the kind real models use, where a
    token can be a piece of a UTF-8 character that decodes to no text on its own (a random-weight
    model samples such tokens, and engines then stream events with empty text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=SPECIALS[4:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def llama_config(tokenizer, layers: int, hidden: int):
    """A Llama shape: head size 64, half as many KV heads, SwiGLU width about 8/3 of hidden."""
    from transformers import LlamaConfig

    heads = max(1, hidden // 64)
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=(hidden * 8 // 3 + 63) // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, dtype="bfloat16")


def build_model(tokenizer, layers: int, hidden: int, random_state: int):
    """A LlamaForCausalLM with random weights."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(tokenizer, layers, hidden)
    torch.manual_seed(random_state)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = None  # decode every requested token (module docstring)
    model.generation_config.do_sample = False
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024, help="a multiple of 64")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--random-state", type=int, default=0, help="the weights' random state")
    p.add_argument("--tokenizer", choices=("words", "bpe"), default="words",
                   help="words: every token decodes to a word; bpe: byte-level BPE, as real models have")
    p.add_argument("--no-weights", action="store_true", help="write config and tokenizer only, for an "
                   "engine that makes random weights itself (vLLM --load-format dummy); needs no torch")
    args = p.parse_args(argv)
    if args.hidden % 64 or args.layers < 1:
        p.error("--hidden must be a multiple of 64 and --layers at least 1")
    try:
        tokenizer = (build_bpe_tokenizer if args.tokenizer == "bpe" else build_tokenizer)(args.vocab)
    except ValueError as e:
        p.error(str(e))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.no_weights:
        config = llama_config(tokenizer, args.layers, args.hidden)
        config.save_pretrained(args.out_dir)
        tokenizer.save_pretrained(args.out_dir)
        print(f"{args.out_dir}: LlamaForCausalLM config, {args.layers} layers, hidden {args.hidden}, vocab "
              f"{len(tokenizer)}, no weights (serve with --load-format dummy)", file=sys.stderr)
        return 0
    model = build_model(tokenizer, args.layers, args.hidden, args.random_state)
    model.save_pretrained(args.out_dir)   # config.json, generation_config.json, model.safetensors
    tokenizer.save_pretrained(args.out_dir)
    params = sum(t.numel() for t in model.parameters())
    print(f"{args.out_dir}: LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, "
          f"vocab {len(tokenizer)}, {params / 1e6:.1f}M parameters (bf16)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
