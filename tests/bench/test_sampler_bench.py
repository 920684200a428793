"""`bench/sampler.py`'s GPU calls, run on CPU at a small vocabulary (the harness a GPU
session runs first; its times here are no claim): every variant is timed, and the chunked
and radix-search calls give the tokens of the one-stage, bisecting ones."""

from bench.sampler import child


def test_gpu_calls_run_and_agree_on_cpu():
    out = child([3], 1, vocab=4096, gpu_calls=True)
    ms = out["ms"]["3"]
    for k in ("sample_top_p", "sample_top_p_peaked", "sample_top_k50_peaked"):
        assert ms[f"{k}_chunked"] > 0
        for r in (0, 2, 4):
            assert ms[f"{k}_chunked_radix{r}"] > 0
            assert out["radix_same_tokens"][f"3/{k}/{r}"] == 1.0
    assert set(out["chunked_same_tokens"].values()) == {1.0}
    assert ms["top_k128"] > 0 and ms["chunked_top_k128_c512"] > 0
