"""Build the sandbox image offline: debootstrap a minimal Debian with python3, then ``docker import``.

Why not ``docker pull python:3-slim``? The machines this project targets reach a Debian apt mirror but
no container registry, so the image is assembled from Debian packages: ``debootstrap --variant=minbase
--include=python3`` into a temporary directory, a little trimming (apt caches, docs), and ``docker
import`` of the tree with a versioned tag. The full ``python3`` package is installed on purpose:
``python3-minimal`` lacks ``json``, ``unittest``, ``ctypes`` and ``multiprocessing``.

The build is idempotent (an existing tag is left alone unless ``force``), needs root (debootstrap
mounts and chroots) and takes about a minute on a fast mirror. The mirror is read from
``TOOLGYM_DEBIAN_MIRROR`` or from the host's apt sources, falling back to ``deb.debian.org``.

Run it as ``toolgym sandbox build`` or ``python -m toolgym.tools.sandbox.image``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from toolgym.errors import SandboxError

__all__ = ["DEFAULT_IMAGE", "build_command", "build_image", "debian_mirror", "image_exists"]

log = logging.getLogger(__name__)

#: The image every sandbox uses by default. Bump the tag when the image's contents change.
DEFAULT_IMAGE = "toolgym-sandbox:1"
#: Debian release the image is built from.
SUITE = "bookworm"
_DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: Directories removed from the tree before import: nothing in the sandbox needs them.
_TRIM = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info")


def debian_mirror() -> str:
    """The Debian mirror to bootstrap from: ``TOOLGYM_DEBIAN_MIRROR``, else the host's apt sources."""
    if os.environ.get("TOOLGYM_DEBIAN_MIRROR"):
        return os.environ["TOOLGYM_DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        # deb822 stanzas ("URIs: ... / Suites: bookworm ...") and one-line "deb URL bookworm main".
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if uris and suites and SUITE in suites.group(1).split() and "security" not in uris.group(1):
                return uris.group(1)
        for match in re.finditer(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s", text, re.M):
            if match.group(2) == SUITE:
                return match.group(1)
    return _DEFAULT_MIRROR


def _client() -> Any:  # docker ships no type information
    from toolgym.tools.sandbox.reaper import docker_client

    return docker_client()


def image_exists(image: str = DEFAULT_IMAGE) -> bool:
    """Whether the Docker engine already has ``image``."""
    import docker.errors

    try:
        _client().images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


def build_image(image: str = DEFAULT_IMAGE, *, force: bool = False, mirror: str | None = None) -> str:
    """Build ``image`` unless it exists; return the image id.

    Raises:
        SandboxError: not root, debootstrap missing or failing, or the import failing; the message
            says how to fix it.
    """
    client = _client()
    if not force and image_exists(image):
        log.info("sandbox image %s already exists; nothing to do", image)
        return str(client.images.get(image).id)
    if shutil.which("debootstrap") is None:
        raise SandboxError(
            "building the sandbox image needs debootstrap. Fix: apt-get install -y debootstrap"
        )
    if os.geteuid() != 0:
        raise SandboxError(
            "building the sandbox image needs root (debootstrap chroots). Fix: run it with sudo"
        )
    mirror = mirror or debian_mirror()
    repository, _, tag = image.rpartition(":")
    if not repository:
        repository, tag = image, "latest"
    from rich.console import Console

    console = Console(stderr=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="toolgym-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        cmd = ["debootstrap", "--variant=minbase", "--include=python3", SUITE, str(root), mirror]
        log.info("running %s", " ".join(cmd))
        tail: list[str] = []
        with console.status(f"debootstrap {SUITE} from {mirror}") as status:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                tail = (tail + [line.rstrip()])[-20:]
                status.update(f"[{time.monotonic() - start:5.0f} s] debootstrap: {line.strip()[:90]}")
            if proc.wait() != 0:
                raise SandboxError(
                    f"debootstrap failed (exit {proc.returncode}) from mirror {mirror}; last lines:\n"
                    + "\n".join(tail)
                    + "\nFix: check the mirror (TOOLGYM_DEBIAN_MIRROR) is reachable"
                )
            status.update("trimming and packing the root file system")
            for rel in _TRIM:
                shutil.rmtree(root / rel, ignore_errors=True)
            # The tmpfs mounted on /work copies this directory's mode: make it world-writable + sticky.
            (root / "work").mkdir(exist_ok=True)
            os.chmod(root / "work", 0o1777)
            tarball = Path(tmp) / "rootfs.tar"
            subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tarball), "."], check=True)
            status.update(f"docker import as {image}")
            changes = [
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV LANG=C.UTF-8",
                "ENV PYTHONDONTWRITEBYTECODE=1",
                "WORKDIR /work",
                "LABEL toolgym.sandbox.image=1",
            ]
            client.api.import_image_from_file(str(tarball), repository=repository, tag=tag, changes=changes)
    image_id = str(client.images.get(image).id)
    log.info("built %s (%s) in %.0f s", image, image_id[:19], time.monotonic() - start)
    console.print(f"built {image} ({image_id[:19]}) in {time.monotonic() - start:.0f} s")
    return image_id


def build_command() -> None:
    """Entry point of ``toolgym sandbox build``: build the default image if it is missing."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    force = os.environ.get("TOOLGYM_SANDBOX_REBUILD") == "1"
    if not force and image_exists(DEFAULT_IMAGE):
        print(f"{DEFAULT_IMAGE} already exists (set TOOLGYM_SANDBOX_REBUILD=1 to rebuild)")
        return
    build_image(DEFAULT_IMAGE, force=force)


if __name__ == "__main__":
    build_command()
