"""Process-wide settings: the compilation cache folder fills with compiled programs; the allocator setting
applies on glibc and can be switched off. Each check runs in a fresh process (both settings are per process)."""

import os
import subprocess
import sys
import textwrap


def _run(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAXLM_TUNE"))}
    environ.update(env, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_compilation_cache_is_used_and_an_explicit_jax_setting_wins(tmp_path):
    code = """
        import jax, jax.numpy as jnp
        from jaxlm import runtime
        print(runtime.use_compilation_cache(%r))
        jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()
    """
    mine = tmp_path / "mine"
    assert _run(code % str(mine)) == str(mine)
    assert any(mine.iterdir())  # the compiled program was written there
    theirs = tmp_path / "theirs"
    assert _run(code % str(mine), JAX_COMPILATION_CACHE_DIR=str(theirs)) == str(theirs)
    assert _run(code % "") == "None"


def test_allocator_setting_applies_on_glibc_and_can_be_switched_off():
    code = "from jaxlm import runtime; print(runtime.tune_for_xla_cpu())"
    expected = "True" if sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION") else "False"
    assert _run(code) == expected
    assert _run(code, JAXLM_TUNE_MALLOC="0") == "False"
