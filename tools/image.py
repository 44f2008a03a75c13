"""Build fleetd's container image with Debian's podman, here, where no registry is reachable.

The Dockerfile builds unchanged; what this machine needs around it:

* **The base image.** ``python:3.11-slim-bookworm`` cannot be pulled, so a stand-in is made
  with ``mmdebstrap`` (Debian bookworm: its Python is 3.11 too) and imported under that tag.
  It carries the host's CA certificates, because pip inside the build verifies TLS against
  them, and no ``EXTERNALLY-MANAGED`` marker, like the official image (its pip installs into
  the system Python).  Made once; later builds find it in podman's store.
* **The runtime.** ``runc``: ``crun`` fails here on cgroups in hybrid mode.
* **Limits.** podman's default RLIMIT_NOFILE is above the host's hard limit, which it cannot
  raise without CAP_SYS_RESOURCE: ``nofile`` and ``nproc`` are set to the host's own limits.
* ``--format docker`` keeps the HEALTHCHECK (OCI images have none); ``--pull=never``.

Usage::

    python -m tools.image base     # the stand-in base, if podman's store lacks it
    python -m tools.image build    # base, then the image (tag: fleetd:local)
"""

from __future__ import annotations

import argparse
import glob
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_TAG = "docker.io/library/python:3.11-slim-bookworm"
IMAGE_TAG = "localhost/fleetd:local"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
HOST_CAS = "/usr/local/share/ca-certificates"


CONTAINER_NPROC = 4096
"""A supervisor, a shard per CPU and their threads need far fewer; runc refuses values above the
kernel's ``pid_max`` here, whatever the host's hard limit says."""


def limits() -> list[str]:
    """``--ulimit`` options within the host's hard limits (podman's defaults exceed them here)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = CONTAINER_NPROC if nproc == resource.RLIM_INFINITY else min(nproc, CONTAINER_NPROC)
    out = ["--ulimit", f"nproc={nproc}:{nproc}"]
    if nofile != resource.RLIM_INFINITY:
        out += ["--ulimit", f"nofile={nofile}:{nofile}"]
    return out


def podman_run_options() -> list[str]:
    """What ``podman run`` needs here, besides the caller's own options."""
    return ["--runtime", "runc", *limits()]


def podman(*args: str, check: bool = True, capture: bool = False, timeout: float | None = None,
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], check=check, text=True, timeout=timeout,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)


def has_image(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def make_base(log: Path | None = None) -> None:
    """Import the stand-in base under ``BASE_TAG`` unless podman's store has it already."""
    if has_image(BASE_TAG):
        return
    cas = " ".join(sorted(glob.glob(f"{HOST_CAS}/*.crt")))
    copy_cas = (f'mkdir -p "$1{HOST_CAS}" && cp {cas} "$1{HOST_CAS}/" && chroot "$1" update-ca-certificates'
                if cas else "true")
    with tempfile.TemporaryDirectory(prefix="fleetd-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        cmd = ["mmdebstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
               f"--customize-hook={copy_cas}",
               '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
               "bookworm", str(rootfs), DEBIAN_MIRROR]
        with open(log or "/dev/null", "a") as out:
            subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT)
        podman("import", "--change", 'CMD ["python3"]', "--change", "ENV LANG=C.UTF-8", str(rootfs), BASE_TAG,
               capture=True)


def build(tag: str = IMAGE_TAG, log: Path | None = None) -> float:
    """Build the Dockerfile under ``tag``; the wall time in seconds."""
    started = time.monotonic()
    make_base(log)
    cmd = ["build", "--pull=never", "--format", "docker", "--runtime", "runc", *limits(), "-t", tag, str(ROOT)]
    with open(log or "/dev/null", "a") as out:
        subprocess.run(["podman", *cmd], check=True, stdout=out, stderr=subprocess.STDOUT)
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.image", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["base", "build"])
    p.add_argument("--tag", default=IMAGE_TAG)
    args = p.parse_args(argv)
    if args.what == "base":
        make_base()
    else:
        print(f"built {args.tag} in {build(args.tag):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
