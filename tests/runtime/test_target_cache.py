"""runtime.target_cache: a compile-only program's figures kept on disk, read back instead of
compiling again. The mechanics do not depend on the compiler, so this machine's XLA:CPU
stands in for XLA:TPU here (tests/runtime/test_targets.py runs it with libtpu)."""
import json

import jax
import jax.numpy as jnp
import pytest

from jaxscale.measure import memory
from jaxscale.model.flops import xla_flops
from jaxscale.runtime import target_cache as TC
from jaxscale.runtime.targets import parse_target

V5E = parse_target("v5e-4")


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """The cache's folder, in tmp_path."""
    monkeypatch.setattr(TC, "folder", lambda: tmp_path / "targets")
    return tmp_path / "targets"


def _lowered(n: int = 32):
    return jax.jit(lambda x: jnp.tanh(x @ x).sum(0)).lower(jnp.ones((n, n), jnp.float32))


class _Refusing:
    """A lowered program whose compiler refuses it (`why`), counting the tries."""

    def __init__(self, why: str):
        self.why, self.tries = why, 0

    def as_text(self) -> str:
        return f"module @refused {{ {self.why} }}"

    def compile(self):
        self.tries += 1
        raise jax.errors.JaxRuntimeError(self.why)


def test_a_second_compile_reads_back_every_figure_the_first_gave(kept):
    """The figures, compiled now and read back, against jax's own Compiled."""
    truth = _lowered().compile()
    first, how_first = TC.compile_for(_lowered(), V5E)
    again, how_again = TC.compile_for(_lowered(), V5E)
    assert (how_first, how_again) == ("compiled", "cache") and len(list(kept.glob("*.json"))) == 1
    for kept_program in (first, again):
        assert isinstance(kept_program, TC.KeptProgram)
        assert memory.memory(kept_program) == memory.memory(truth)
        assert memory.needed_bytes(kept_program) == memory.needed_bytes(truth)
        assert xla_flops(kept_program) == xla_flops(truth) > 0
        assert kept_program.as_text() == truth.as_text()


def test_the_key_names_the_program_the_target_the_compilers_and_their_flags(monkeypatch):
    key = TC.key(_lowered(), V5E)
    assert key == TC.key(_lowered(), V5E)  # the same program lowered again
    assert TC.key(_lowered(16), V5E) != key
    assert TC.key(_lowered(), parse_target("v5e-8")) != key
    assert TC.key(_lowered(), parse_target("h100-8")) != TC.key(_lowered(), parse_target("h200-8"))
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=false")
    assert TC.key(_lowered(), V5E) != key
    assert any(v.startswith("jaxlib==") for v in TC.compiler_versions())


def test_a_refusal_for_memory_is_kept_and_raised_again_without_compiling(kept):
    why = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory: 20G of 16G"
    program = _Refusing(why)
    for source in ("compiled", "cache"):
        with pytest.raises(jax.errors.JaxRuntimeError) as e:
            TC.compile_for(program, V5E)
        assert str(e.value) == why and memory.refusal(e.value) == memory.refusal(
            jax.errors.JaxRuntimeError(why))
        assert getattr(e.value, "compile_source", "compiled") == source
    assert program.tries == 1


@pytest.mark.parametrize("text, said", [
    ("RESOURCE_EXHAUSTED: Ran out of memory: 20G of 16G\nmore", "Ran out of memory: 20G of 16G"),
    ("RESOURCE_EXHAUSTED:  ", "RESOURCE_EXHAUSTED:"),  # no sentence: the error itself
    ("INTERNAL: the compiler crashed", None),
])
def test_a_refusal_is_the_compilers_first_sentence(text, said):
    assert TC.refusal(jax.errors.JaxRuntimeError(text)) == said


def test_any_other_compile_error_is_not_kept(kept):
    program = _Refusing("INTERNAL: the compiler crashed")
    for _ in range(2):
        with pytest.raises(jax.errors.JaxRuntimeError):
            TC.compile_for(program, V5E)
    assert program.tries == 2 and not kept.exists()


def test_a_file_cut_short_is_compiled_again_and_replaced(kept):
    TC.compile_for(_lowered(), V5E)
    (path,) = kept.glob("*.json")
    path.write_text(path.read_text()[:100])
    assert TC.compile_for(_lowered(), V5E)[1] == "compiled"
    assert json.loads(path.read_text())["version"] == TC.VERSION
    assert TC.compile_for(_lowered(), V5E)[1] == "cache"
    assert [p.suffix for p in kept.iterdir()] == [".json"]  # no temporary file left


def test_without_a_cache_folder_nothing_is_kept(monkeypatch, tmp_path):
    monkeypatch.setattr(TC, "folder", lambda: None)
    assert [TC.compile_for(_lowered(), V5E)[1] for _ in range(2)] == ["compiled", "compiled"]
