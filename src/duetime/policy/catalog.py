"""The registered policies: one line each (see :mod:`duetime.policy.registry`)."""

from duetime.policy.balancing import LoadAware, RoundRobin, ShortestQueue
from duetime.policy.cache_aware import CacheAware, PrefixLoad
from duetime.policy.deadline import DeadlineSfs
from duetime.policy.latency import LatencyAgnostic, Lps, Sfs, SoftSfs, Throughput
from duetime.policy.lora import LoraAffinity
from duetime.policy.registry import register
from duetime.policy.retry import ExpectedTtca, Laar, SessionAffinity
from duetime.policy.slo_headroom import SloHeadroom

register(RoundRobin)
register(ShortestQueue)
register(LoadAware)
register(LatencyAgnostic)
register(Sfs)
register(SoftSfs)
register(Throughput)
register(Lps)
register(SessionAffinity)
register(Laar)
register(ExpectedTtca)
register(PrefixLoad)
register(CacheAware)
register(LoraAffinity)
register(DeadlineSfs)
register(SloHeadroom)
