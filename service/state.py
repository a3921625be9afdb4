"""Typed application state: the one ``web.AppKey`` every handler reads its services from."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from .admit import Admitter
from .auth import TokenCache
from .config import Settings
from .core_client import CoreClient
from .core_sim import CoreSimulator
from .db import Database
from .dispatch import Dispatcher
from .hub import EventHub
from .listener import Listener
from .promoter import Promoter
from .sweeper import Sweeper


@dataclass
class Services:
    settings: Settings
    db: Database
    core: CoreClient
    admitter: Admitter
    dispatcher: Dispatcher
    promoter: Promoter
    sweeper: Sweeper
    listener: Listener | None
    tokens: TokenCache
    events: EventHub
    simulator: CoreSimulator | None = None
    migrated: bool = False
    stopping: bool = False


SERVICES = web.AppKey("services", Services)
