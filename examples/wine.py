"""The wine classifier from the tutorials (13 -> 64 -> 3 MLP, Adam), on phalanx.

python examples/wine.py                           # one process
phalanx run --nproc-per-node 2 examples/wine.py   # two processes, same script
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Phalanx


class SimpleNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(13, 64)
        self.fc2 = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def load_data():
    x, y = load_wine(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=42)
    scaler = StandardScaler().fit(x_train)

    def dataset(x, y):
        return TensorDataset(torch.tensor(scaler.transform(x), dtype=torch.float32), torch.tensor(y))

    return dataset(x_train, y_train), dataset(x_test, y_test)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--strategy", default=None, help="ddp, zero1, zero2, zero3, ... (default: auto)")
    args = parser.parse_args()

    px = Phalanx(strategy=args.strategy)
    torch.manual_seed(0)
    train_set, test_set = load_data()
    model = SimpleNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size)
    model, optimizer, train_loader, test_loader = px.prepare(model, optimizer, train_loader, test_loader)

    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros((), device=px.device)
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            px.backward(loss)
            optimizer.step()
            total += loss.detach()
        if epoch % 10 == 0 or epoch == args.epochs - 1:
            px.print(f"epoch {epoch}: loss {px.reduce(total / len(train_loader)).item():.4f}")

    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for x, y in test_loader:
            preds, labels = px.gather_for_metrics((model(x).argmax(dim=1), y))
            correct += (preds == labels).sum().item()
            seen += labels.numel()
    px.print(
        f"test accuracy: {correct / seen:.4f} on {seen} samples ({px.world_size} process(es), "
        f"strategy {px.strategy_name})"
    )


if __name__ == "__main__":
    main()
