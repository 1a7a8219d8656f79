"""The service's layers name every module and package of kvops/ (.importlinter's
service-layers contract): lint-imports checks only what a layer names, so a module left out
of every layer could import anything."""
import configparser
import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_kvops_module_and_package_has_a_layer():
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    contract = config["importlinter:contract:service-layers"]
    named = {name.strip() for line in contract["layers"].split("\n") if line.strip()
             for name in re.split(r"[:|]", line)}
    children = {module.name for module in pkgutil.iter_modules([str(ROOT / "kvops")])}
    assert children - named == set(), "modules of kvops/ in no layer of .importlinter"
    assert named - children == set(), "layers of .importlinter that kvops/ does not have"
