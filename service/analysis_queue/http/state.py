"""Typed application state: the one ``web.AppKey`` every handler reads its services from."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from analysis_queue.config import Settings
from analysis_queue.core.client import CoreClient
from analysis_queue.dev.core_sim import CoreSimulator
from analysis_queue.http.auth import TokenCache
from analysis_queue.http.edge import Edge
from analysis_queue.http.scrape import DatabaseGauges
from analysis_queue.loops.dispatch import Dispatcher
from analysis_queue.loops.hub import EventHub
from analysis_queue.loops.listener import Listener
from analysis_queue.loops.promote import Promoter
from analysis_queue.loops.sweep import Sweeper
from analysis_queue.metrics import Metrics
from analysis_queue.queue.admit import Admitter
from analysis_queue.queue.finish import Finisher
from analysis_queue.store.database import Database


@dataclass
class Services:
    settings: Settings
    metrics: Metrics
    db: Database
    core: CoreClient
    admitter: Admitter
    finisher: Finisher
    dispatcher: Dispatcher
    promoter: Promoter
    sweeper: Sweeper
    listener: Listener | None
    tokens: TokenCache
    events: EventHub
    gauges: DatabaseGauges
    edge: Edge
    simulator: CoreSimulator | None = None
    migrated: bool = False
    stopping: bool = False


SERVICES = web.AppKey("services", Services)
