"""Builds mlacp._C with the project's CMake (the same build as the C++ library and tool), against
the torch of the running Python. `pip install --no-build-isolation .`; the build folder is
$MLACP_BUILD_DIR (default build-torch2/, shared with the C++ suite on LibTorch 2.x)."""
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch

        build = pathlib.Path(os.environ.get("MLACP_BUILD_DIR", ROOT / "build-torch2"))
        torch_root = pathlib.Path(torch.__file__).parent
        env = dict(os.environ)
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # no GPU to detect on a build machine
        subprocess.check_call([
            "cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DMLACP_BUILD_PYTHON=ON",
            f"-DPython3_EXECUTABLE={sys.executable}", f"-DCMAKE_PREFIX_PATH={torch_root};{torch_root / 'share/cmake'}",
        ], env=env)
        jobs = os.environ.get("MLACP_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build), "--target", "mlacp_python", "-j", jobs], env=env)
        built = next((build / "python" / "mlacp").glob("_C*.so"))
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)


setup(ext_modules=[Extension("mlacp._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
