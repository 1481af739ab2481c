"""A real (tiny) authoritative DNS server on loopback UDP, built from dnspython parts."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import cast

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class LoopbackDns(asyncio.DatagramProtocol):
    """Answers from a zone held in memory; counts the queries it sees.

    ``add("_matrix-fed._tcp.x.test", "SRV", "10 5 8448 target.test.")``;
    ``fail(name)`` makes queries for ``name`` answer SERVFAIL.
    """

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.ttl = 300
        self.failing: set[str] = set()
        self.queries: list[tuple[str, str]] = []
        self.transport: asyncio.DatagramTransport | None = None
        self.port = 0

    def add(self, name: str, rdtype: str, value: str) -> None:
        self.records[(name.rstrip(".").lower(), rdtype)].append(value)

    def fail(self, name: str) -> None:
        self.failing.add(name.rstrip(".").lower())

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        self.queries.append((name, rdtype))
        if name in self.failing:
            response.set_rcode(dns.rcode.SERVFAIL)
        elif values := self.records.get((name, rdtype)):
            response.answer.append(
                dns.rrset.from_text_list(question.name, self.ttl, "IN", rdtype, values)
            )
        elif not any(n == name for n, _ in self.records):
            response.set_rcode(dns.rcode.NXDOMAIN)
        self.transport.sendto(response.to_wire(), addr)

    def count(self, name: str, rdtype: str) -> int:
        return self.queries.count((name, rdtype))


async def start_dns() -> LoopbackDns:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(
        LoopbackDns, local_addr=("127.0.0.1", 0)
    )
    protocol.port = transport.get_extra_info("sockname")[1]
    return protocol
