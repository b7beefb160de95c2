"""Deterministic local corpus + byte-level GPT-2 BPE tokenizer files (no download).

Corpus: the top-level *.py files of this Python's standard library (sorted by name),
cut at line boundaries into documents of ~4000 characters, until ~4 MB; one JSON line
{"text": ...} per document.  Tokenizer: vocab.json = the 256 byte-encoder characters of
GPT-2's bytes_to_unicode (ids 0..255) + "<|endoftext|>" (256); merges.txt = header only,
so every byte is one token."""
import json, os, sys, sysconfig

out = sys.argv[1]
target = int(sys.argv[2]) if len(sys.argv) > 2 else 4_000_000
os.makedirs(out, exist_ok=True)

def bytes_to_unicode():  # identical to megatron/tokenizer/gpt2_tokenization.py
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2 ** 8):
        if b not in bs:
            bs.append(b); cs.append(2 ** 8 + n); n += 1
    return dict(zip(bs, [chr(c) for c in cs]))

enc = bytes_to_unicode()
vocab = {enc[b]: b for b in range(256)}
vocab["<|endoftext|>"] = 256
json.dump(vocab, open(os.path.join(out, "vocab.json"), "w", encoding="utf-8"), ensure_ascii=False)
open(os.path.join(out, "merges.txt"), "w", encoding="utf-8").write("#version: 0.2\n")

lib = sysconfig.get_paths()["stdlib"]
files = sorted(f for f in os.listdir(lib) if f.endswith(".py"))
total, ndocs = 0, 0
with open(os.path.join(out, "corpus.jsonl"), "w", encoding="utf-8") as fo:
    for f in files:
        try:
            text = open(os.path.join(lib, f), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        doc = []
        size = 0
        for line in text.splitlines(keepends=True):
            doc.append(line); size += len(line)
            if size >= 4000:
                fo.write(json.dumps({"text": "".join(doc)}) + "\n"); ndocs += 1; total += size
                doc, size = [], 0
        if doc:
            fo.write(json.dumps({"text": "".join(doc)}) + "\n"); ndocs += 1; total += size
        if total >= target:
            break
print(f"corpus: {ndocs} documents, {total} characters, from {lib} ({sys.version.split()[0]})")
