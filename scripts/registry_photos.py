"""Builds tests/fixtures/photos/registry/: a few hundred real photos, with their authors,
sources and licences, from a package registry (Debian's `gcompris-qt-data`, the GCompris
educational suite's data; most photos come from Wikimedia Commons and
publicdomainpictures.net). They widen the precision fidelity set beyond the 40 photos of
tests/fixtures/photos/{small,medium,large}.

GCompris ships its images inside Qt resource bundles (`.rcc`); this reads that format
(header `qres`, a tree of entries, UTF-16 names, data optionally zlib-compressed), keeps
the photos of the activities that use photographs, and reads each image folder's README
(`Copyright:`, `Source:`, `License:`, `Files:` blocks) into SOURCES.md. Photos without a
licence entry or author, or under a licence other than public domain, CC0, CC-BY or
CC-BY-SA, are left out.

    python scripts/registry_photos.py [--deb gcompris-qt-data_3.1-2_all.deb]

Without --deb it runs `apt-get download gcompris-qt-data=3.1-2` (Debian bookworm).
"""

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "photos" / "registry"
PACKAGE = "gcompris-qt-data=3.1-2"
# Activities whose images are photographs (the others are drawings), and sub-folders of
# them that are not (letters and digits).
ACTIVITIES = [
    "categorization",
    "erase",
    "explore_monuments",
    "explore_world_animals",
    "explore_farm_animals",
]
NOT_PHOTOS = {"alphabets", "numbers"}
# Licences that allow redistribution with these tests, by attribution at most (share-alike
# binds only the photos themselves, which are kept unchanged): public domain, CC0, CC-BY
# and CC-BY-SA. Non-commercial and no-derivatives variants, and anything else, are left out.
FREE = re.compile(r"(public domain|cc0(-1\.0)?|cc-by(-sa)?[- ][1234]\.0)")


def rcc_files(path):
    """(path inside the bundle, bytes) of every file of a Qt resource bundle."""
    b = Path(path).read_bytes()
    if b[:4] != b"qres":
        raise ValueError(f"{path}: not a Qt resource bundle")
    version, tree, data, names = struct.unpack(">IIII", b[4:20])
    entry = 14 if version == 1 else 22

    def name(offset):
        (length,) = struct.unpack(">H", b[names + offset : names + offset + 2])
        start = names + offset + 6  # length, then a 4-byte hash
        return b[start : start + 2 * length].decode("utf-16-be")

    out = []
    stack = [(0, "")]
    while stack:
        index, prefix = stack.pop()
        at = tree + index * entry
        name_offset, flags = struct.unpack(">IH", b[at : at + 6])
        here = prefix + "/" + name(name_offset) if index else ""
        if flags & 2:  # a directory: child count, first child
            count, first = struct.unpack(">II", b[at + 6 : at + 14])
            stack.extend((first + i, here) for i in range(count))
            continue
        (offset,) = struct.unpack(">I", b[at + 10 : at + 14])
        (size,) = struct.unpack(">I", b[data + offset : data + offset + 4])
        blob = b[data + offset + 4 : data + offset + 4 + size]
        if flags & 1:  # qCompress: 4-byte length, then zlib
            blob = zlib.decompress(blob[4:])
        elif flags & 4:
            raise ValueError(f"{path}: zstd-compressed entry {here}")
        out.append((here.lstrip("/"), blob))
    return out


def readme_entries(text):
    """{file name: {copyright, source, license}} from a GCompris image README."""
    entries = {}
    for block in re.split(r"\n\s*\n", text):
        fields, files, key = {}, [], None
        for line in block.splitlines():
            m = re.match(r"(Copyright|Source|License|Comments|Files):\s*(.*)", line)
            if m:
                key, value = m.group(1).lower(), m.group(2).strip()
                if key == "files":
                    files.extend(value.split())
                else:
                    fields[key] = value
            elif key == "files":
                files.extend(line.split())
            elif key is not None and line.strip():
                # A field's continuation line (a second author, a long source).
                fields[key] = f"{fields[key]} {line.strip()}".strip()
        if "license" in fields:
            for f in files:
                entries[f] = fields
    return entries


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deb", help="the package file (else apt-get download fetches it)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb
        if deb is None:
            subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True)
            deb = next(Path(tmp).glob("gcompris-qt-data_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], check=True)
        files = {}
        for rcc in sorted(Path(f"{tmp}/x/usr/share/gcompris-qt/rcc").glob("*.rcc")):
            for name, blob in rcc_files(rcc):
                files[name] = blob
    photos, readmes = {}, {}
    for name, blob in files.items():
        parts = name.split("/")
        if "activities" not in parts:
            continue
        activity = parts[parts.index("activities") + 1]
        if activity not in ACTIVITIES or NOT_PHOTOS & set(parts):
            continue
        folder = "/".join(parts[:-1])
        if parts[-1] == "README":
            readmes[folder] = readme_entries(blob.decode("utf-8", "replace"))
        elif name.endswith(".webp"):
            photos[name] = (folder, parts[-1], activity, blob)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    rows, skipped = [], []
    for name in sorted(photos):
        folder, file, activity, blob = photos[name]
        # The README of its folder, or of a folder above naming it by its relative path.
        info, parts = None, folder.split("/")
        for up in range(len(parts), 0, -1):
            relative = "/".join(parts[up:] + [file])
            info = readmes.get("/".join(parts[:up]), {}).get(relative)
            if info is not None:
                break
        licence = info["license"].strip().lower() if info else ""
        if info is None or not FREE.fullmatch(licence) or not info.get("copyright"):
            skipped.append(name)
            continue
        group = folder.split("/")[-1]
        stored = f"{activity}-{group}-{file}" if group != "resource" else f"{activity}-{file}"
        if (OUT / stored).exists():
            raise SystemExit(f"two photos would be stored as {stored}")
        (OUT / stored).write_bytes(blob)
        cells = [
            stored,
            info["copyright"],
            info.get("source", ""),
            info["license"],
            info.get("comments", ""),
        ]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    with open(OUT / "SOURCES.md", "w") as f:
        f.write(
            f"# Registry photos\n\n{len(rows)} photos from Debian's `{PACKAGE}` (GCompris's "
            "data: images inside its Qt resource bundles), extracted by "
            "`scripts/registry_photos.py` with the author, source and licence its image "
            "folders' READMEs give each file. GCompris cropped, resized or sharpened some of "
            "them (the last column, from its READMEs); they are used unchanged from the "
            "package.\n\n"
            "| file | copyright | source | licence | changes (GCompris's) |\n"
            "| --- | --- | --- | --- | --- |\n"
        )
        f.write("\n".join(rows) + "\n")
    print(f"registry photos: {len(rows)} written to {OUT}, {len(skipped)} left out (no licence entry, or another licence)")
    for s in skipped:
        print("  left out:", s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
