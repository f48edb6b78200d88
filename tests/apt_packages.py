"""Installing Debian packages a test needs (SLURM, Prometheus), as root and only when missing."""

import os
import subprocess


def apt_install(packages) -> str | None:
    """apt-get install `packages`, updating the lists once if the first try fails; None on success,
    else the end of apt-get's error output."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    if subprocess.run(install, env=env, capture_output=True).returncode == 0:
        return None
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
    result = subprocess.run(install, env=env, capture_output=True, text=True)
    return None if result.returncode == 0 else result.stderr.strip()[-500:]
