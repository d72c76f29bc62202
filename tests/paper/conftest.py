"""tests/paper's tests run on one torch CPU thread (restored after each module). The tiny twins' forwards take a few
milliseconds; a second thread only adds synchronisation, and on a busy machine its waits cost more CPU time than the
work (docs/efficiency.md, "Threads on a CPU"; backbones.choose_threads gives a tiny backbone's run one thread too)."""
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
