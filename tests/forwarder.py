"""A TCP forwarder in front of a server: the tests SIGKILL it to show a run what a server that dies looks like (its
connections reset, its port refused), while the server behind it, shared by the tests of a pytest worker, serves on.

    python tests/forwarder.py LISTEN_PORT TARGET_PORT     # prints "ready" once it listens
"""

import asyncio
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def forward(listen_port: int, target_port: int) -> None:
    async def connect(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    listener = await asyncio.start_server(connect, "127.0.0.1", listen_port)
    print("ready", flush=True)
    async with listener:
        await listener.serve_forever()


if __name__ == "__main__":
    asyncio.run(forward(int(sys.argv[1]), int(sys.argv[2])))
