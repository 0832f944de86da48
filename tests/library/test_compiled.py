"""linicl.compiled.enable_persistent_cache: JAX's on-disk compilation cache for entry points."""

import subprocess
import sys
import textwrap

import pytest

from linicl import compiled


def test_cache_dir_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(compiled.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compiled.persistent_cache_dir() == tmp_path / "linicl" / "jax"
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert compiled.persistent_cache_dir() == tmp_path / "elsewhere"
    assert compiled.persistent_cache_dir(tmp_path / "arg") == tmp_path / "arg"  # the argument wins
    for off in ("off", "OFF", "0", "none", ""):
        monkeypatch.setenv(compiled.CACHE_ENV, off)
        assert compiled.persistent_cache_dir() is None and compiled.enable_persistent_cache() is None


def test_a_second_process_reads_the_executables_the_first_wrote(tmp_path):
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from linicl import compiled
        assert compiled.enable_persistent_cache({str(tmp_path / 'cache')!r}, min_compile_s=0) is not None
        f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
        print(float(f(jnp.ones((8, 8)))))
    """)
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    written = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert written, "no executable was written"
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == written  # read, not compiled again


def test_unwritable_folder_warns_and_leaves_the_cache_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="cache off"):
        assert compiled.enable_persistent_cache(blocker / "cache") is None
    with pytest.raises(ValueError, match="min_compile_s"):
        compiled.enable_persistent_cache(tmp_path / "c", min_compile_s=-1)
