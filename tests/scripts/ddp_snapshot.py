"""Test worker: a plain torchrun-style DDP client (no elasticrun imports).

Modelled on pytorch/examples' ddp-tutorial-series ``multinode.py``: gloo on CPU, DDP on a
tiny model, a DataLoader with a DistributedSampler, a snapshot saved with ``torch.save`` by
rank 0 after every epoch and resumed from on a restart, ``destroy_process_group()`` at the end.

usage: ddp_snapshot.py TOTAL_EPOCHS SNAPSHOT_PATH
Test hooks (not elasticrun's): DDP_SAMPLES=N samples; DDP_EPOCH_SLEEP=S sleeps S s after each
epoch; with DDP_KILL_AFTER_EPOCH=E and DDP_KILL_MARKER=path, global rank 1 SIGKILLs itself once
after epoch E (the marker file makes it happen only once).
"""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, snapshot_path: str) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path, map_location="cpu")
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
            print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)
        self.model = DDP(self.model)

    def _run_batch(self, source, targets) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Steps: {len(self.train_data)}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs: int) -> None:
        kill_after = int(os.environ.get("DDP_KILL_AFTER_EPOCH", "-1"))
        epoch_sleep = float(os.environ.get("DDP_EPOCH_SLEEP", "0"))
        marker = os.environ.get("DDP_KILL_MARKER", "")
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            time.sleep(epoch_sleep)
            if self.global_rank == 0:
                self._save_snapshot(epoch)
            if epoch == kill_after and self.global_rank == 1 and marker and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)


def main(total_epochs: int, snapshot_path: str) -> None:
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    dataset = MyTrainDataset(int(os.environ.get("DDP_SAMPLES", "256")))
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = DataLoader(dataset, batch_size=32, pin_memory=True, shuffle=False,
                            sampler=DistributedSampler(dataset))
    trainer = Trainer(model, train_data, optimizer, snapshot_path)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
