import subprocess
import sys


def test_backend_resolves_by_name_without_importing_zenflow():
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='zenflow')\n"
        "assert f(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]\n"
        "assert 'zenflow.runtime.cpu_adam' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
