from click.testing import CliRunner

from fp8kit.cli import main


def test_demo_prints_every_scheme():
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    table, _, note = result.stdout.partition("\n\n")
    rows = {tuple(line.split()[:2]) for line in table.splitlines()[2:]}
    assert {("dynamic", "compressed-tensors"), ("block", "compressed-tensors"), ("tensor", "compressed-tensors"),
            ("block", "fp8")} <= rows
    assert "fp8-format row" in note and "weights alone" in note  # measured unlike the other rows: said so
    for line in table.splitlines()[3:]:
        kl, top1 = float(line.split()[4]), float(line.split()[5])
        assert 0 < kl < 5e-3 and top1 > 0.5, line


def test_logit_drift_against_a_float64_reference_and_masked_tokens():
    """KL(ref || fp8) per token, averaged over positions; a token both models give -inf (a masked vocabulary entry)
    contributes 0: it made the whole KL NaN."""
    import torch

    from fp8kit.quality import logit_drift

    g = torch.Generator().manual_seed(0)
    ref, got = torch.randn(2, 3, 10, generator=g), torch.randn(2, 3, 10, generator=g)
    p, q = ref.double().softmax(-1), got.double().softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1).mean().item()
    assert abs(logit_drift(ref, got)["kl"] - expected) <= 1e-12
    ref[..., -2:], got[..., -2:] = float("-inf"), float("-inf")
    p, q = ref[..., :-2].double().softmax(-1), got[..., :-2].double().softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1).mean().item()
    drift = logit_drift(ref, got)
    assert abs(drift["kl"] - expected) <= 1e-12 and drift["top1"] == (p.argmax(-1) == q.argmax(-1)).double().mean()
    got[0, 0, 0] = float("-inf")  # the FP8 model rules out a token the source allows: infinite, not NaN
    assert logit_drift(ref, got)["kl"] == float("inf")


def test_a_seed_out_of_torchs_range_is_a_usage_error():
    """It was a traceback (torch.manual_seed: Overflow when unpacking long long)."""
    result = CliRunner().invoke(main, ["demo", "--seed", str(2**64)])
    assert result.exit_code == 2 and "--seed" in result.output and "Traceback" not in result.output
