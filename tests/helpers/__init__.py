"""What the tests share: the workflow helper, the fake coordinator, the Slurm test cluster,
the chaos tests' site process, stand-ins and captured data (docs/tests.md)."""

from pathlib import Path

#: captured outputs the tests read (Slurm 22.05's sbatch and sacct among them)
DATA = Path(__file__).resolve().parent / "data"
