#!/usr/bin/env python3
"""Checks that moetrain's tokenizer.json BPE gives the ids Hugging Face `tokenizers` gives.

For each tokenizer shape below, it trains a byte-level BPE with the `tokenizers` package on
generated multilingual text (vocabulary ~2000, special tokens <|endoftext|>, <|im_start|>,
<|im_end|>), saves its tokenizer.json, and compares, on a varied multilingual test text:

  * encoding: `moetrain tokenize --tokenizer T --encode-text FILE` against
    Tokenizer.encode(text, add_special_tokens=False).ids;
  * decoding: `moetrain tokenize --tokenizer T --decode-ids FILE` against
    Tokenizer.decode(ids, skip_special_tokens=False).

Shapes: qwen2 (NFC, Split with Qwen2's regex, ByteLevel without regex: Qwen2/Qwen3),
gpt2 (ByteLevel with its regex and a prefix space), llama3 (Llama 3's regex, digits in
runs of three, ignore_merges), deepseek (three Splits in a row, as DeepSeek-V3 has).
--also PATH adds existing tokenizer.json files (a real Qwen3 one, say) to the comparison.

Edge texts (rare whitespace and format characters, random code points across Unicode,
very long runs) are compared too, but only reported: PCRE2 and the Oniguruma engine that
`tokenizers` uses may disagree on such characters (Unicode versions, U+180E in \\s).

Prints one line per shape and text, then PASS or FAIL (with the first mismatch: position,
both ids and token strings, and the text around it); exits 0 on PASS, 1 on FAIL.

    python3 tools/check_tokenizer.py --moetrain build/moetrain [--also path/to/tokenizer.json]

moetrain itself does not use Python; this script is a check for a machine that has the
`tokenizers` package.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]

# Sentences in many scripts; the test text and the training text are both made from them.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog while 3 dogs watch.",
    "I'm sure they'll say we've done what you'd NEVER'VE thought; it's DON'T and Don't, isn’t it?",
    "Prices rose 3.5% to $1,234.56 on 2024-05-17T12:34:56Z (see https://example.com/a?b=1&c=2).",
    "Write to first.last+tag@example.org or call +1 (555) 010-9999 before 11:59 p.m.",
    "Français : à la façon de caf\u00e9 crème brûlée, naïve coöperate, Œuvre, déjà vu.",
    "Deutsch: Straße, Äpfel, Übermut, größer; Español: ¿dónde está el niño? ¡Olé!",
    "Português: ação, coração, São Paulo; Türkçe: İstanbul, ılık, şeker, ğ; Polski: żółć.",
    "Русский: Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Ελληνικά: Γειά σου Κόσμε· ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "中文：你好，世界！我们今天学习机器学习和自然语言处理。",
    "日本語：こんにちは、世界。カタカナとひらがなと漢字が混ざった文章です。",
    "한국어: 안녕하세요, 세계! 다람쥐 헌 쳇바퀴에 타고파.",
    "العربية: مرحبا بالعالم، هذا نصٌّ عربيٌّ مع تشكيل.",
    "עברית: שָׁלוֹם עוֹלָם, זה טקסט בעברית.",
    "हिन्दी: नमस्ते दुनिया, यह एक परीक्षण वाक्य है।",
    "ไทย: สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Tiếng Việt: Xin chào thế giới, tiếng Việt có dấu.",
    "Emoji: 👋🏽 hi 👨‍👩‍👧 family 🇫🇷 flag ❤️ love 😀😀😀 ok",
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ = π ≈ 3.14159; ½ + ¼ = ¾; Ⅻ, ٣٤, ௧௨.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++\r\nint main() { return 0; }\r\n",
    "{\"key\": \"value\", \"list\": [1, 2.5e-3, true, null], \"nested\": {\"x\": -42}}",
    "| col A | col B |\n|-------|-------|\n| **bold** | _it_ |\n\n> quote\n- item\n",
    "  leading spaces, trailing spaces   \n\n\n  indented\tline\t\ttabs \u00a0nbsp\u3000ideographic",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello<|im_end|><|endoftext|>",
    "Not quite special: <|im_sta <|im_end <|endoftext|<|endoftext|>> <| |>",
    "Numbers: 0 7 42 123 4567 89012 3456789 1,000,000 1_000 0x1F 1e10 ４２ ٤٢",
]

# moetrain passes an NFC normalizer through (docs/choices.md), so the texts are NFC already.
SENTENCES = [unicodedata.normalize("NFC", s) for s in SENTENCES]

EDGE_TEXTS = {
    "format and rare space characters":
        "a\u180eb c\u200bd e\ufefff g\u2028h i\u2029j k\u0085l m\u001cn o\u001fp \u00adq \u2060r",
    "leading combining mark and lone marks": "\u0301abc \u0308 \u20dd x\u0300\u0301\u0302",
    "long whitespace and long word": " " * 5000 + "x" + "\n" * 300 + "y" * 5000 + "\t" * 100,
    "random code points": None,  # filled in main()
}


def training_text(seed):
    rng = random.Random(seed)
    words = " ".join(SENTENCES).split(" ")
    lines = []
    for _ in range(6000):
        n = rng.randint(3, 25)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.2:
            line += " " + str(rng.randint(0, 10 ** rng.randint(1, 9)))
        lines.append(line)
    lines += SENTENCES * 20
    return lines


def test_text():
    return "\n\n".join(SENTENCES)


def random_code_points(seed, n=3000):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        cp = rng.choice([rng.randint(0x20, 0x7F), rng.randint(0xA0, 0x2FFF), rng.randint(0x3000, 0xD7FF),
                         rng.randint(0xE000, 0xFFFD), rng.randint(0x10000, 0x1FAFF)])
        ch = chr(cp)
        if unicodedata.normalize("NFC", ch) == ch:
            out.append(ch)
    return unicodedata.normalize("NFC", "".join(out))


def supports_ignore_merges():
    # The BPE option appeared in tokenizers 0.19.1; older versions ignore the key.
    import tokenizers
    version = tuple(int(x) for x in tokenizers.__version__.split(".")[:3] if x.isdigit())
    return version >= (0, 19, 1)


def train(shape, lines, vocab_size, path):
    tok = Tokenizer(models.BPE())
    if shape == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif shape == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    elif shape == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif shape == "deepseek":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in DEEPSEEK] +
            [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    tok.save(path)
    if shape == "llama3" and supports_ignore_merges():
        # Llama 3 sets ignore_merges; the trainer does not, so set it in the file and reload.
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        j["model"]["ignore_merges"] = True
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
    return Tokenizer.from_file(path)


def moetrain(binary, tokenizer_path, flag, path):
    r = subprocess.run([binary, "tokenize", "--tokenizer", tokenizer_path, flag, path], capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"moetrain {flag} failed ({r.returncode}): {r.stderr.decode(errors='replace')}"
                           f"{r.stdout.decode(errors='replace')[-2000:]}")
    return r.stdout


def encode_with_moetrain(binary, tokenizer_path, text, work):
    path = os.path.join(work, "text.txt")
    with open(path, "wb") as f:
        f.write(text.encode("utf-8"))
    out = moetrain(binary, tokenizer_path, "--encode-text", path).decode("utf-8", errors="replace")
    # The ids are the last line that is a JSON array (log lines may come before it).
    lines = [l for l in out.splitlines() if l.startswith("[")]
    return json.loads(lines[-1])


def decode_with_moetrain(binary, tokenizer_path, ids, work):
    path = os.path.join(work, "ids.json")
    with open(path, "w") as f:
        json.dump(ids, f)
    return moetrain(binary, tokenizer_path, "--decode-ids", path)


def describe_mismatch(tok, text, ours, theirs):
    enc = tok.encode(text, add_special_tokens=False)
    i = next((k for k in range(min(len(ours), len(theirs))) if ours[k] != theirs[k]), min(len(ours), len(theirs)))
    lo, hi = max(0, i - 3), i + 4
    name = lambda ids: [f"{x}:{tok.id_to_token(x)!r}" for x in ids]
    where = ""
    if i < len(enc.offsets):
        a, b = enc.offsets[i]
        where = f"\n      text around it: {text[max(0, a - 30):b + 30]!r}"
    return (f"first difference at token {i} (moetrain {len(ours)} ids, tokenizers {len(theirs)})\n"
            f"      moetrain:   {name(ours[lo:hi])}\n      tokenizers: {name(theirs[lo:hi])}{where}")


def check(binary, name, tok, path, texts, work, required):
    ok = True
    for label, text in texts.items():
        theirs = tok.encode(text, add_special_tokens=False).ids
        try:
            ours = encode_with_moetrain(binary, path, text, work)
        except RuntimeError as e:
            print(f"  {name:10s} {label:40s} ERROR {e}")
            ok = ok and not required
            continue
        if ours != theirs:
            print(f"  {name:10s} {label:40s} {'MISMATCH' if required else 'differs (edge, not counted)'}: "
                  f"{describe_mismatch(tok, text, ours, theirs)}")
            ok = ok and not required
            continue
        decoded = decode_with_moetrain(binary, path, theirs, work)
        expected = tok.decode(theirs, skip_special_tokens=False).encode("utf-8")
        if decoded != expected:
            k = next((j for j in range(min(len(decoded), len(expected))) if decoded[j] != expected[j]), 0)
            print(f"  {name:10s} {label:40s} DECODE MISMATCH at byte {k}: moetrain {decoded[k:k + 40]!r} "
                  f"tokenizers {expected[k:k + 40]!r}")
            ok = ok and not required
            continue
        print(f"  {name:10s} {label:40s} same ({len(ours)} ids)")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moetrain", default="build/moetrain", help="the moetrain binary")
    ap.add_argument("--vocab", type=int, default=2000, help="vocabulary size to train")
    ap.add_argument("--shapes", default="qwen2,gpt2,llama3,deepseek")
    ap.add_argument("--also", action="append", default=[], help="an existing tokenizer.json to compare too")
    ap.add_argument("--work", help="keep the files here (default: a temporary folder)")
    args = ap.parse_args()
    if not os.access(args.moetrain, os.X_OK):
        sys.exit(f"{args.moetrain}: not an executable moetrain binary (build it, or pass --moetrain)")

    work = args.work or tempfile.mkdtemp(prefix="check_tokenizer_")
    os.makedirs(work, exist_ok=True)
    EDGE_TEXTS["random code points"] = random_code_points(7)
    texts = {"multilingual test text": test_text()}
    for k, s in enumerate(SENTENCES):
        texts[f"sentence {k}"] = s
    lines = training_text(1)

    ok = True
    for shape in args.shapes.split(","):
        path = os.path.join(work, f"{shape}.json")
        tok = train(shape, lines, args.vocab, path)
        print(f"{shape}: {tok.get_vocab_size()} ids, {path}")
        ok &= check(args.moetrain, shape, tok, path, texts, work, required=True)
        check(args.moetrain, shape, tok, path, EDGE_TEXTS, work, required=False)
    for path in args.also:
        tok = Tokenizer.from_file(path)
        print(f"{path}: {tok.get_vocab_size()} ids")
        ok &= check(args.moetrain, os.path.basename(os.path.dirname(path)) or "also", tok, path, texts, work,
                    required=True)
        check(args.moetrain, "also", tok, path, EDGE_TEXTS, work, required=False)

    print("PASS: moetrain's ids and decoded text equal the tokenizers package's" if ok else
          "FAIL: see the mismatches above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
