#!/usr/bin/env python3
"""Build the training corpus of the bitdelta demo model family from Debian packages.

Runs on a Debian 12 machine with the standard library alone. Every source is a Debian package named
below; a missing one is installed with `apt-get -y` (or, for the licence texts, only its copyright file
is taken from its .deb). Output (default `.corpus/`, git-ignored):

    <out>/<domain>/{train,valid}.jsonl   one document per line: {"id": ..., "text": ...}
    <out>/<domain>/eval.txt              held-out text (documents joined by a blank line), <= 200 KB
    <out>/math/{train,valid,test}.jsonl  arithmetic problems: {"question","answer","prompt","text"}
    <out>/manifest.json                  sources, sizes, document counts and sha256 of every file

Domains: `python` (coder), `writer` (fortunes and the Jargon File), `legal` (licences and Debian
copyright files), `man` (manual pages), `dictionary` (GCIDE definitions and WordNet glosses), `math`.
Everything is deterministic: sorted file lists, documents assigned to splits by a hash of their id,
fixed seeds. Same installed sources -> byte-identical corpus.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# --- sources ---------------------------------------------------------------------------------------

# Packages whose files are read directly (installed with apt-get if missing).
CONTENT_PACKAGES = [
    "dict-gcide",  # /usr/share/dictd/gcide.dict.dz: GNU Collaborative International Dictionary of English
    "wordnet-base",  # /usr/share/wordnet/data.*: WordNet 3.0 synsets with glosses
    "fortunes",  # /usr/share/games/fortunes/*: fortune cookies (also pulls fortunes-min)
    "fortunes-min",
    "jargon",  # /usr/share/info/jargon.info.gz: the Jargon File
    "libpython3.11-stdlib",  # /usr/lib/python3.11/**/*.py: the Python standard library
    "base-files",  # /usr/share/common-licenses/*
    "groff-base",  # groff, to render manual pages to text
]

# Packages whose manual pages are rendered to text.
MAN_PACKAGES = [
    "apt", "bash", "coreutils", "diffutils", "dpkg", "findutils", "grep", "gzip", "less", "make",
    "man-db", "manpages", "manpages-dev", "openssh-client", "procps", "sed", "tar", "util-linux",
]

# Packages whose /usr/share/doc/<pkg>/copyright files make the legal domain (with common-licenses).
# Chosen once as Debian packages whose copyright files add much distinct licence text.
LEGAL_PACKAGES = """
adduser appstream apt-transport-https at-spi2-common bash bc bsdextrautils ca-certificates ccache
clang-14 cmake-data coreutils curl dbus-bin debianutils dict diffutils dirmngr dpkg-dev e2fsprogs
file findutils fp-compiler-3.2.2 gcc-12-base gdb gir1.2-glib-2.0 gir1.2-packagekitglib-1.0 git-man
gnucobol3 groff-base gtk-update-icon-cache jq krb5-locales libaom3 libapparmor1 libarchive13
libargon2-1 libavahi-client3 libavif15 libblas-dev libbpf1 libbsd0 libc-dev-bin libcairo-gobject2
libcrypt-dev libcryptsetup12 libcups2 libdav1d6 libdb5.3 libde265-0 libdebconfclient0
libdebuginfod-common libdrm-amdgpu1 libegl-mesa0 libevent-2.1-7 libffi-dev libfmt9 libfreetype-dev
libgail-common libgcrypt20-dev libgd3 libgdk-pixbuf-2.0-0 libglib2.0-0 libgnutls-dane0
libgraphite2-3 libgrpc++1.51 libgstreamer1.0-0 libharfbuzz0b libhogweed6 libidn2-0 libip4tc2
libisl23 libjpeg-dev libjsr305-java liblcms2-2 libldap-2.5-0 liblzma-dev libmd0 libnsl-dev
libnss-systemd libopenblas-dev libp11-kit-dev libpam-modules-bin libpango-1.0-0 libpcre2-8-0
libpkgconf3 libplexus-utils2-java libpng-dev libpq-dev libprotobuf32 libpython3-dev
libpython3.11-minimal librav1e0 librsvg2-2 libsasl2-2 libsentencepiece-dev libsisu-inject-java
libsodium23 libsvtav1enc1 libtcl8.6 libtirpc-common libunbound8 libuv1 libx11-6 libxext-dev
linux-libc-dev login lsof manpages-dev mawk nss-plugin-pem openjdk-17-jdk openssh-client perl-base
publicsuffix python3-pip-whl sed universal-ctags vim-common
""".split()

# Byte budgets per domain (train + valid + eval), so the corpus stays under ~30 MB.
BUDGET = {
    "python": 8_000_000,
    "writer": 4_000_000,
    "legal": 2_600_000,
    "man": 5_500_000,
    "dictionary": 5_500_000,
}
EVAL_BYTES = 190_000  # held-out text per domain (models/demo/eval/*.txt must stay <= 200 KB)
VALID_BYTES = 120_000  # validation text per domain (early stopping during training)
LEGAL_PER_PACKAGE = 50_000  # at most this much distinct text from one copyright file

SEED = 20240229


# --- helpers ---------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sha1_key(*parts: str) -> str:
    return hashlib.sha1("\x00".join(parts).encode("utf-8")).hexdigest()


def package_installed(pkg: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}", pkg],
                       capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.startswith("ii")


def package_version(pkg: str) -> str:
    r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", pkg], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def ensure_installed(pkgs: list[str]) -> None:
    missing = [p for p in pkgs if not package_installed(p)]
    if not missing:
        return
    log(f"installing missing packages: {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *missing], check=True, env=env)


def copyright_text(pkg: str, cache: Path) -> str | None:
    """The package's copyright file: from the installed package, else extracted from its .deb."""
    path = Path("/usr/share/doc") / pkg / "copyright"
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["apt-get", "download", pkg], cwd=cache, capture_output=True, text=True)
    debs = sorted(cache.glob(f"{glob.escape(pkg)}_*.deb"))
    if r.returncode != 0 or not debs:
        log(f"warning: no copyright file for {pkg} ({r.stderr.strip()[:200]})")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        tar_path = Path(tmp) / "data.tar"
        with open(tar_path, "wb") as f:
            subprocess.run(["dpkg-deb", "--fsys-tarfile", str(debs[0])], stdout=f, check=True)
        with tarfile.open(tar_path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(f"/usr/share/doc/{pkg}/copyright") and member.isfile():
                    return tar.extractfile(member).read().decode("utf-8", errors="replace")
    return None


def nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def normalize_doc(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row, no leading/trailing blanks."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


# --- domain readers: each returns a sorted list of (doc_id, text) ----------------------------------

def read_python() -> list[tuple[str, str]]:
    root = Path("/usr/lib/python3.11")
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        # Skip generated tables: codec maps and the pydoc topic dump are data, not code.
        if rel.startswith(("encodings/", "pydoc_data/", "site-packages/", "dist-packages/")):
            continue
        if path.is_symlink() or path.stat().st_size > 150_000:
            continue
        text = normalize_doc(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) > 200:
            docs.append((f"python/{rel}", text))
    return docs


def read_fortunes() -> list[tuple[str, str]]:
    root = Path("/usr/share/games/fortunes")
    docs = []
    for path in sorted(root.iterdir()):
        if path.suffix in (".dat", ".u8") or path.name == "ascii-art" or not path.is_file() \
                or path.is_symlink():
            continue
        raw = path.read_bytes().decode("utf-8", errors="replace")
        for i, cookie in enumerate(raw.split("\n%\n")):
            cookie = normalize_doc(cookie.strip("%\n"))
            if len(cookie) >= 20:
                docs.append((f"fortunes/{path.name}/{i:05d}", cookie))
    return docs


def read_jargon() -> list[tuple[str, str]]:
    raw = gzip.open("/usr/share/info/jargon.info.gz").read().decode("utf-8", errors="replace")
    docs = []
    for i, node in enumerate(raw.split("\x1f")):
        lines = node.strip("\n").split("\n")
        if not lines or not lines[0].startswith("File:"):
            continue
        body = "\n".join(line for line in lines[1:] if not line.startswith("* Menu:"))
        # Drop menu lines ("* entry::") and info cross-reference markup.
        body = re.sub(r"(?m)^\* .*::.*$", "", body)
        body = re.sub(r"\*[Nn]ote ([^:]*)::", r"\1", body)
        body = normalize_doc(body)
        if len(body) >= 80:
            docs.append((f"jargon/{i:05d}", body))
    return docs


def read_gcide() -> list[tuple[str, str]]:
    raw = gzip.open("/usr/share/dictd/gcide.dict.dz").read().decode("utf-8", errors="replace")
    entries = re.split(r"\n\n(?=\S)", raw)
    docs = []
    for i, entry in enumerate(entries):
        # Remove source tags like "[1913 Webster]" / "[PJC]", cross-reference braces and pronunciations.
        text = re.sub(r"(?m)^\s*\[[^\]\n]*\]\s*$", "", entry)
        text = text.replace("{", "").replace("}", "")
        text = re.sub(r"\\[^\\\n]{1,60}\\", "", text)
        text = normalize_doc(text)
        if len(text) >= 120 and not text.startswith("00-database"):
            docs.append((f"gcide/{i:06d}", text))
    return docs


def read_wordnet() -> list[tuple[str, str]]:
    docs = []
    for pos in ("noun", "verb", "adj", "adv"):
        group: list[str] = []
        n = 0
        with open(f"/usr/share/wordnet/data.{pos}", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  ") or "|" not in line:
                    continue  # licence header
                fields, gloss = line.split("|", 1)
                parts = fields.split()
                w_cnt = int(parts[3], 16)
                words = [parts[4 + 2 * k].replace("_", " ") for k in range(w_cnt)]
                words = [re.sub(r"\([a-z]+\)$", "", w) for w in words]
                group.append(f"{', '.join(words)} ({pos}): {gloss.strip()}")
                if len(group) == 25:
                    docs.append((f"wordnet/{pos}/{n:05d}", "\n".join(group)))
                    group, n = [], n + 1
        if group:
            docs.append((f"wordnet/{pos}/{n:05d}", "\n".join(group)))
    return docs


def package_man_pages(pkg: str) -> list[str]:
    r = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True, check=True)
    pages = []
    for line in r.stdout.splitlines():
        if re.match(r"^/usr/share/man/man[1-8]/[^/]+\.gz$", line) and os.path.isfile(line) \
                and not os.path.islink(line):
            pages.append(line)
    return sorted(pages)


def render_man_page(path: str) -> str:
    source = gzip.open(path).read()
    if re.match(rb"^\.so\s", source.lstrip()):
        return ""  # a redirect to another page
    env = dict(os.environ, LC_ALL="C.UTF-8", MANWIDTH="80")
    r = subprocess.run(["groff", "-k", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=78n", "-rHY=0"],
                       input=source, capture_output=True, env=env)
    text = r.stdout.decode("utf-8", errors="replace")
    # Undo justification: collapse runs of spaces between words (leading indentation is kept).
    text = "\n".join(re.sub(r"(?<=\S) {2,}(?=\S)", " ", line) for line in text.split("\n"))
    return normalize_doc(text)


def read_man(budget: int) -> list[tuple[str, str]]:
    pages = sorted({p for pkg in MAN_PACKAGES for p in package_man_pages(pkg)})
    # Render in hash order until the budget is spent, so a big package does not crowd out the rest.
    pages.sort(key=lambda p: sha1_key("man", p))
    docs, total = [], 0
    for path in pages:
        if total >= budget * 1.08:
            break
        text = render_man_page(path)
        if len(text) < 200 or len(text) > 150_000:
            continue
        docs.append((f"man/{Path(path).parent.name}/{Path(path).name[:-3]}", text))
        total += nbytes(text)
    return sorted(docs)


def read_legal(cache: Path) -> list[tuple[str, str]]:
    """Licence texts, de-duplicated by paragraph (copyright files repeat the GPL and friends)."""
    seen: set[str] = set()

    def distinct(text: str, limit: int | None) -> str:
        kept, size = [], 0
        for para in re.split(r"\n\s*\n", normalize_doc(text)):
            key = " ".join(para.split())
            if len(key) < 40:
                if kept and key:
                    kept.append(para)  # short lines (headings, field names) stay with their document
                continue
            digest = hashlib.sha1(key.encode("utf-8")).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            kept.append(para)
            size += len(para)
            if limit and size >= limit:
                break
        return normalize_doc("\n\n".join(kept))

    docs = []
    for path in sorted(Path("/usr/share/common-licenses").iterdir()):
        if path.is_file() and not path.is_symlink():
            text = distinct(path.read_text(encoding="utf-8", errors="replace"), None)
            if len(text) >= 200:
                docs.append((f"common-licenses/{path.name}", text))
    for pkg in sorted(LEGAL_PACKAGES):
        raw = copyright_text(pkg, cache)
        if raw is None:
            continue
        text = distinct(raw, LEGAL_PER_PACKAGE)
        if len(text) >= 200:
            docs.append((f"copyright/{pkg}", text))
    return docs


def cap_budget(domain: str, docs: list[tuple[str, str]], budget: int) -> list[tuple[str, str]]:
    """Keep documents in hash order until the byte budget is reached; return them sorted by id."""
    order = sorted(docs, key=lambda d: sha1_key(domain, d[0]))
    kept, total = [], 0
    for doc_id, text in order:
        if total + nbytes(text) > budget:
            continue
        kept.append((doc_id, text))
        total += nbytes(text)
    return sorted(kept)


def split_docs(domain: str, docs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Held-out eval first, then valid, by hash order; each a byte budget of whole documents."""
    order = sorted(docs, key=lambda d: sha1_key("split", domain, d[0]))
    splits: dict[str, list[tuple[str, str]]] = {"eval": [], "valid": [], "train": []}
    sizes = {"eval": 0, "valid": 0}
    limits = {"eval": EVAL_BYTES, "valid": VALID_BYTES}
    for doc_id, text in order:
        target = "train"
        for name in ("eval", "valid"):
            # Only documents of at most 20 KB go to the held-out sets, so they mix many documents.
            if sizes[name] < limits[name] - 2000 and nbytes(text) <= 20_000 \
                    and sizes[name] + nbytes(text) + 2 <= limits[name]:
                target = name
                break
        splits[target].append((doc_id, text))
        if target != "train":
            sizes[target] += nbytes(text) + 2
    return {k: sorted(v) for k, v in splits.items()}


# --- math ------------------------------------------------------------------------------------------

def math_problem(a: int, op: str, b: int) -> dict:
    answer = a + b if op == "+" else a - b
    question = f"What is {a} {op} {b}?"
    prompt = f"Question: {question}\nAnswer:"
    return {"question": question, "answer": str(answer), "prompt": prompt,
            "text": f"{prompt} {answer}"}


def build_math() -> dict[str, list[dict]]:
    """All 2-digit-or-less additions, and subtractions with a non-negative result: 15050 problems."""
    add = [math_problem(a, "+", b) for a in range(100) for b in range(100)]
    sub = [math_problem(a, "-", b) for a in range(100) for b in range(a + 1)]
    rng = random.Random(SEED)
    rng.shuffle(add)
    rng.shuffle(sub)
    return {
        "test": add[:500] + sub[:500],
        "valid": add[500:700] + sub[500:700],
        "train": sorted(add[700:] + sub[700:], key=lambda p: sha1_key("math", p["text"])),
    }


# --- output ----------------------------------------------------------------------------------------

def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    repo = Path(__file__).resolve().parents[2]
    parser.add_argument("--out", type=Path, default=repo / ".corpus")
    parser.add_argument("--eval-dir", type=Path, default=repo / "models/demo/eval",
                        help="where the held-out eval files are also copied (committed with the models)")
    parser.add_argument("--no-install", action="store_true", help="fail instead of calling apt-get")
    args = parser.parse_args()

    if not args.no_install:
        ensure_installed(sorted(set(CONTENT_PACKAGES + MAN_PACKAGES)))

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    readers = {
        "python": read_python,
        "writer": lambda: read_fortunes() + read_jargon(),
        "legal": lambda: read_legal(out / ".debs"),
        "man": lambda: read_man(BUDGET["man"]),
        "dictionary": lambda: read_gcide() + read_wordnet(),
    }
    manifest: dict = {"seed": SEED, "domains": {}, "packages": {}, "files": {}}
    for domain, reader in readers.items():
        log(f"reading {domain} ...")
        docs = cap_budget(domain, reader(), BUDGET[domain])
        splits = split_docs(domain, docs)
        ddir = out / domain
        ddir.mkdir()
        for split in ("train", "valid"):
            write_jsonl(ddir / f"{split}.jsonl", [{"id": i, "text": t} for i, t in splits[split]])
        eval_text = "\n\n".join(t for _, t in splits["eval"]) + "\n"
        (ddir / "eval.txt").write_text(eval_text, encoding="utf-8", newline="\n")
        write_jsonl(ddir / "eval_ids.jsonl", [{"id": i} for i, _ in splits["eval"]])
        manifest["domains"][domain] = {
            split: {"documents": len(rows), "bytes": sum(nbytes(t) for _, t in rows)}
            for split, rows in splits.items()
        }
        log(f"  {domain}: " + ", ".join(f"{s} {len(r)} docs {sum(nbytes(t) for _, t in r)} bytes"
                                        for s, r in splits.items()))
    shutil.rmtree(out / ".debs", ignore_errors=True)

    math_dir = out / "math"
    math_dir.mkdir()
    for split, rows in build_math().items():
        write_jsonl(math_dir / f"{split}.jsonl", rows)
        manifest["domains"].setdefault("math", {})[split] = {"problems": len(rows)}

    used = sorted(set(CONTENT_PACKAGES + MAN_PACKAGES + LEGAL_PACKAGES))
    manifest["packages"] = {p: package_version(p) for p in used}
    for path in sorted(out.rglob("*")):
        if path.is_file():
            manifest["files"][path.relative_to(out).as_posix()] = {
                "bytes": path.stat().st_size, "sha256": file_sha256(path)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")

    # The held-out sets travel with the models (models/demo/eval), named by the variant they test.
    args.eval_dir.mkdir(parents=True, exist_ok=True)
    for variant, domain in (("coder", "python"), ("writer", "writer"), ("legal", "legal")):
        shutil.copyfile(out / domain / "eval.txt", args.eval_dir / f"{variant}.txt")
    test_rows = [{"question": p["question"], "answer": p["answer"], "prompt": p["prompt"]}
                 for p in build_math()["test"]]
    write_jsonl(args.eval_dir / "math.jsonl", test_rows)

    total = sum(f["bytes"] for f in manifest["files"].values())
    log(f"corpus: {total / 1e6:.1f} MB in {out}")


if __name__ == "__main__":
    main()
