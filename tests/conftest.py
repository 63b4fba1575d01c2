import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None, max_examples=40)
settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

ROOT = Path(__file__).resolve().parents[1]


def _compile_each_cached_kernel_once():
    """The two xdist workers share numba's on-disk cache, but a kernel that both need at about the same time
    compiled in both (5-25 s each, on two busy cores). Here a cached function compiles under a lock file of its
    own: the second worker waits, then loads the first one's cache entry (numba's ``compile`` looks in the cache
    before compiling). Callees lock inside their callers' locks; the call graph has no cycles, so no deadlock."""
    try:
        import fcntl
        from numba.core.caching import NullCache
        from numba.core.dispatcher import Dispatcher
    except ImportError:
        return
    import hashlib
    import tempfile
    checkout = hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"multiteacher-numba-locks-{checkout}"
    folder.mkdir(exist_ok=True)
    compile_unlocked, held = Dispatcher.compile, set()

    def compile(self, sig):
        if isinstance(self._cache, NullCache) or id(self) in held:
            return compile_unlocked(self, sig)
        with open(folder / f"{self.py_func.__module__}.{self.py_func.__qualname__}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held.add(id(self))
            try:
                return compile_unlocked(self, sig)
            finally:
                held.discard(id(self))

    Dispatcher.compile = compile


_compile_each_cached_kernel_once()

TIERS = ("unit", "property", "integration", "slow")


QUICK_FIXTURES = {"quick_regret": "regret", "quick_mechanisms": "mechanisms", "quick_spectrum": "rollout_spectrum",
                  "quick_forgetting": "forgetting", "quick_rlvr": "rlvr"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Every test has a tier: hypothesis tests are ``property``; a test without a tier mark is ``unit``.
    Tests that read one sim's quick run share an xdist group (``-n 2 --dist loadgroup``), so each quick
    run happens once, on one worker. tryfirst: xdist's worker reads the groups into the test ids in its own
    hook of this name, registered after this file, so called before it unless this one goes first."""
    for item in items:
        groups = {QUICK_FIXTURES[f] for f in getattr(item, "fixturenames", ()) if f in QUICK_FIXTURES}
        experiment = getattr(getattr(item, "callspec", None), "params", {}).get("experiment")
        if experiment:
            groups.add(experiment)
        if len(groups) == 1:
            item.add_marker(pytest.mark.xdist_group(groups.pop()))
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.unit)


# torch's CPU kernels round differently on other CPUs (AVX-512, AVX2, ...) and with other thread counts,
# and a training run amplifies that. Every script a test runs, and tests/golden/refresh.py, use the
# portable code paths: generic ATen kernels, MKL's conditional-numerical-reproducibility mode, oneDNN
# without ISA-specific kernels, one thread. The sims without training then write the same CSVs on any x86-64
# machine; those that train torch students still differ between CPU models (measured: an AMD EPYC (Zen 3)
# against copies written on an Intel machine: 1.5e-4 relative in rollout_spectrum's KLs, 0.3% in rlvr's
# accuracies, up to 68% in forgetting's, whose runs diverge), so their golden copies name the CPU
# (:func:`cpu_signature`) and are compared number by number only on that CPU.
PORTABLE_NUMERICS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41",
                     "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cpu_signature():
    """``machine | vendor | model name | family, model | vector extensions`` of this CPU (from /proc/cpuinfo where
    there is one): a virtual machine may name only "AMD EPYC", so the family, model and AVX-512 tell its kinds apart."""
    import platform
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or fields.get("Model") or platform.processor() or "?"
    flags = fields.get("flags", "").split()
    vector = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags) or "-"
    return (f"{platform.machine()} | {fields.get('vendor_id', '?')} | {model} | "
            f"family {fields.get('cpu family', '?')}, model {fields.get('model', '?')} | {vector}")


def run_script(script, *args, check=True, timeout=None):
    """Run ``python <script> args`` from the repository root with :data:`PORTABLE_NUMERICS`; returns the
    CompletedProcess."""
    proc = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=os.environ | PORTABLE_NUMERICS)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_usage_error(proc):
    """A command line refused as the CLI rules ask: exit status 2 and one line on stderr, no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


# The six experiment scripts and the arguments of their --quick runs (tests/golden/refresh.py uses the same).
QUICK_RUNS = {"regret": ["sims/regret.py", "--quick"], "mechanisms": ["sims/mechanisms.py", "all", "--quick"],
              "rollout_spectrum": ["sims/rollout_spectrum.py", "--quick"],
              "estimators": ["sims/estimators.py", "--quick"], "forgetting": ["sims/forgetting.py", "--quick"],
              "rlvr": ["sims/rlvr.py", "--quick"]}


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """The one factory of the quick-run fixtures: ``quick_run(name)`` runs ``QUICK_RUNS[name]`` (figures
    included) once per test session and returns its output folder."""
    done = {}

    def run(name):
        if name not in done:
            out = tmp_path_factory.mktemp(f"{name}-quick")
            proc = run_script(*QUICK_RUNS[name], "--out", out, "--quiet")
            assert proc.stderr.strip().splitlines()[-1] == f"results in {out}"     # absolute, at the end
            done[name] = out
        return done[name]
    return run


@pytest.fixture(scope="session")
def quick_regret(quick_run):
    return quick_run("regret")


@pytest.fixture(scope="session")
def quick_mechanisms(quick_run):
    return quick_run("mechanisms")
