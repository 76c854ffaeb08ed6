"""Tinker gateway: the Tinker API over HTTP, in front of a trainer service.

    python -m services.tinker --trainer_address 127.0.0.1:50052       # HTTP on 127.0.0.1:8096
    TINKER_BASE_URL=http://127.0.0.1:8096 TINKER_API_KEY=tml-... python my_tinker_script.py
"""

from flywheel.runtime.entry import run_main
from services.tinker.config import TinkerConfig

if __name__ == "__main__":
    run_main(service="tinker", config_cls=TinkerConfig, description=__doc__, build="services.tinker.app:build")
