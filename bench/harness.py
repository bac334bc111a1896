# harness: what the kiln-vs-PyTorch scripts of bench/ share, without importing torch (a forked
# child's peak RSS starts from its parent's, so the parent stays small).
#
#   from harness import ROOT, ensure_module, run_measured, torch_config, machine_info, thread_env
#   ensure_module("torch")                       # pip install only when it does not import
#   out, rss_mib = run_measured([binary, "--steps", "10"], thread_env(2))
#
# Used by mnist_vs_pytorch.py and compare.py.
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIME = "/usr/bin/time"


def ensure_module(module, pip_name=None):
    """Installs `module` with pip (as `pip_name`) when it does not import. Checked in a child
    process: importing it here would grow this process. torch falls back to Debian's package
    with OpenBLAS (OpenMP) where PyPI is not reachable (the default reference BLAS is ~30x slower
    and not a fair baseline)."""
    if subprocess.call([sys.executable, "-c", f"import {module}"], stderr=subprocess.DEVNULL) == 0:
        return
    print(f"{module} does not import; installing it with pip", flush=True)
    if subprocess.call([sys.executable, "-m", "pip", "install", pip_name or module]) == 0:
        return
    if module == "torch":
        print("pip failed; trying Debian's python3-torch with OpenBLAS (OpenMP)", flush=True)
        if subprocess.call(["apt-get", "install", "-y", "python3-torch", "libopenblas0-openmp"]) == 0:
            return
    sys.exit(f"cannot install {module}: pip install {pip_name or module}")


def torch_config():
    """PyTorch's version and the BLAS / oneDNN / OpenMP lines of torch.__config__.show()."""
    code = (
        "import torch\n"
        "print(f'torch {torch.__version__}; mkldnn (oneDNN) available: {torch.backends.mkldnn.is_available()}; "
        "mkl available: {torch.backends.mkl.is_available()}')\n"
        "for line in torch.__config__.show().splitlines():\n"
        "    line = line.strip()\n"
        "    if line.startswith('- Build settings:'):\n"
        "        for item in line.split(', '):\n"
        "            if item.split('=')[0].strip('- ').split(': ')[-1] in ('BLAS_INFO', 'LAPACK_INFO', 'USE_MKL', 'USE_MKLDNN', 'USE_OPENMP', 'TORCH_VERSION'):\n"
        "                print('  ' + item.split(': ')[-1])\n"
        "    elif any(k in line for k in ('Math Kernel', 'MKL-DNN', 'oneDNN', 'OpenMP', 'BLAS', 'LAPACK', 'CPU capability')):\n"
        "        print('  ' + line.lstrip('- '))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.rstrip()


def thread_env(threads):
    """The environment both frameworks run in: `threads` OpenMP / MKL / kiln threads."""
    t = str(threads)
    return dict(os.environ, OMP_NUM_THREADS=t, MKL_NUM_THREADS=t, KILN_NUM_THREADS=t)


def run_measured(cmd, env):
    """Runs cmd; returns (its output, its peak RSS in MiB). Exits with the output's tail if it fails."""
    if os.access(TIME, os.X_OK):  # GNU time: a small parent, so the figure is the program's own
        proc = subprocess.run([TIME, "-v"] + cmd, capture_output=True, env=env, text=True)
        out, rss = proc.stdout, re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        if proc.returncode != 0 or not rss:
            sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(out + proc.stderr)[-3000:]}")
        return out.replace("\r", "\n"), int(rss.group(1)) / 1024.0
    # Otherwise wait4's rusage: the same figure, plus whatever of this interpreter the child
    # had before exec (small: torch is never imported here).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}):\n{out[-3000:]}")
    return out.replace("\r", "\n"), usage.ru_maxrss / 1024.0


def _output(cmd, cwd=ROOT):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd).stdout.strip()
    except OSError:
        return ""


def machine_info():
    """What a reader needs to place a figure: CPU, cores, load, kiln's commit, the date."""
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    cpu = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if re.search(rf"\b{f}\b", cpuinfo)]
    rev = _output(["git", "rev-parse", "--short", "HEAD"]) or "?"
    dirty = _output(["git", "status", "--porcelain", "--untracked-files=no"])
    return {
        "cpu": cpu.group(1).strip() if cpu else platform.processor() or "?",
        "isa": " ".join(isa) or "no AVX-512",
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "kiln": rev + ("+local changes" if dirty else ""),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
