"""Packaging for tk: maps the repo folders into the ``tk`` import namespace.

    core/     -> tk.core
    plugins/  -> tk.plugins (each plugin folder is a subpackage)
    recipes/  -> tk.recipes (YAML files shipped as package data)
    _tk/      -> tk (version and ``python -m tk``)
"""

import os
import re

from setuptools import setup


def _read_version() -> str:
    with open(os.path.join("_tk", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def _subpackages(folder: str, namespace: str) -> dict[str, str]:
    """Map every folder with an ``__init__.py`` under ``folder`` to ``namespace.sub``."""
    mapping = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        if "__init__.py" in files:
            rel = os.path.relpath(root, folder)
            name = namespace if rel == "." else namespace + "." + rel.replace(os.sep, ".")
            mapping[name] = root
    return mapping


package_dir = {"tk": "_tk", "tk.recipes": "recipes"}
package_dir.update(_subpackages("core", "tk.core"))
package_dir.update(_subpackages("plugins", "tk.plugins"))

setup(
    name="tk",
    version=_read_version(),
    description="A plugin-based PyTorch toolkit for NLP and vision",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    package_dir=package_dir,
    packages=sorted(package_dir),
    package_data={"tk.recipes": ["*.yaml"]},
    include_package_data=False,
    install_requires=[
        "torch>=2.6,<=2.14.1",
        "torchvision>=0.21,<=0.29.1",
        "timm>=1.0",
        "tokenizers>=0.15",
        "datasets>=2.18",
        "click>=8.1",
        "PyYAML>=6.0",
        "safetensors>=0.4",
        "sacrebleu>=2.3",
        "tqdm>=4.60",
        "numpy>=1.24",
        "matplotlib>=3.7",
        "webdataset>=0.2",  # image_classification data.source: webdataset (its tar shard format; braceexpand)
        "optuna>=4.0",  # tk sweep: samplers, pruners, journal/RDB storage of a study
        "jinja2>=3.1.6",  # chat templates (tk.core.text.chat), rendered as transformers does; 3.1.6 closes sandbox escapes
        "sentencepiece>=0.2",  # Marian/opus-mt translators ship SentencePiece models (source.spm, target.spm), no tokenizer.json
    ],
    extras_require={
        "test": ["pytest>=7.4", "pytest-xdist>=3.0", "transformers>=4.40", "tensorboard>=2.14", "onnx>=1.16", "onnxscript>=0.2",
                 "onnxruntime>=1.18", "fsspec[http]", "peft>=0.11"],  # tensorboard: the logger tests read its event files; onnx*: tk export; http: streamed shards from a local server; peft: tk's PEFT adapters load there
        "remote": ["fsspec[http]", "s3fs", "gcsfs"],  # data.streaming from https://, s3://, gs:// shards
        "tensorboard": ["tensorboard>=2.14"],  # train.loggers: [tensorboard]
        "wandb": ["wandb>=0.17"],  # train.loggers: [wandb]
        "onnx": ["onnx>=1.16", "onnxscript>=0.2"],  # tk export --format onnx
    },
    entry_points={
        "console_scripts": ["tk = tk.core.cli:main"],
        "tk.tasks": [
            "image_classification = tk.plugins.image_classification:ImageClassificationTask",
            "language_model = tk.plugins.language_model:LanguageModelTask",
            "mlm = tk.plugins.mlm:MLMTask",
            "text_classification = tk.plugins.text_classification:TextClassificationTask",
            "translation = tk.plugins.translation:TranslationTask",
            "sft = tk.plugins.sft:SFTTask",
        ],
        "tk.commands": [
            "chat = tk.plugins.sft.cli:chat",
            "generate = tk.plugins.language_model.cli:generate",
            "translate = tk.plugins.translation.cli:translate",
        ],
    },
)
