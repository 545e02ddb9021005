"""Loopback-to-unix-socket forwarder: the proxy's only door into a harness's sandbox.

A command harness runs in a private network namespace (a fresh loopback, nothing else), so
it can reach no host port and no other machine. The proxy listens on a unix socket that is
bound into the sandbox; this script, started inside the sandbox before the harness, listens
on ``127.0.0.1:PORT`` there and pipes every connection to that socket, so the harness's
SDKs talk to ``http://127.0.0.1:PORT`` as to any server.

Run as ``python -I -c SOURCE HOST PORT SOCKET``: standard library only (the source travels
in the argv; no file of ours is mounted). It binds and listens first, then forks: the parent
exits 0 once the port accepts connections (so the harness never races it), the child serves
until the sandbox's pid namespace ends with the harness.
"""
import os
import socket
import sys
import threading


def _pipe(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _serve(conn, target):
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(target)
    except OSError:  # the harness sees its connection closed, as with a server that went away
        conn.close()
        up.close()
        return
    back = threading.Thread(target=_pipe, args=(up, conn), daemon=True)
    back.start()
    _pipe(conn, up)
    back.join()
    conn.close()
    up.close()


def main(host, port, target):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, int(port)))
    srv.listen(128)
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # the harness's output pipe is not ours to hold open
    os.dup2(devnull, 2)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve, args=(conn, target), daemon=True).start()


if __name__ == "__main__":
    main(*sys.argv[1:4])
