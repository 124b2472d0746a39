from click.testing import CliRunner

from fp8kit.cli import main


def test_demo_prints_every_scheme():
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    rows = {tuple(line.split()[:2]) for line in result.stdout.splitlines()[2:]}
    assert {("dynamic", "compressed-tensors"), ("block", "compressed-tensors"), ("tensor", "compressed-tensors"),
            ("block", "fp8")} <= rows
    for line in result.stdout.splitlines()[3:]:
        kl, top1 = float(line.split()[4]), float(line.split()[5])
        assert 0 < kl < 5e-3 and top1 > 0.5, line
