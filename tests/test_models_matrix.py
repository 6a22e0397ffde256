"""docs/models.md's support matrix is what the installed mlx-lm and the engine's load-time check
give today (regenerate it with `python -m parallm.engine.matrix --write`)."""

from pathlib import Path

from parallm.engine import matrix

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def test_support_matrix_is_current_and_complete():
    table = matrix.rows()
    assert matrix.current_section(DOC.read_text()) == matrix.render(table), (
        "docs/models.md's support matrix is stale: run `python -m parallm.engine.matrix --write`")
    assert [r.module for r in table] == matrix.model_modules()
    assert all(r.why for r in table if not r.served)
    served = {r.module for r in table if r.served}
    # the most downloaded attention-only families
    assert {"llama", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe", "mixtral", "gemma3"} <= served
