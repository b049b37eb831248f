"""A GAN on a 2-D toy distribution, trained as most GAN scripts do: per iteration, the
discriminator steps on real and detached fake samples, then the generator steps through the
discriminator; two Adam optimizers, BCE losses, a DataLoader over the real points; both nets'
state_dicts saved at the end.

    python gan.py --out DIR [--iters 40]
"""
import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def ring(count, generator):
    angles = torch.rand(count, generator=generator) * 2 * torch.pi
    radius = 2.0 + 0.1 * torch.randn(count, generator=generator)
    return torch.stack([radius * angles.cos(), radius * angles.sin()], dim=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--latent", type=int, default=8)
    parser.add_argument("--fail-at", type=int, default=-1, help="raise at this iteration")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(5)

    generator_net = nn.Sequential(nn.Linear(args.latent, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64),
                                  nn.LeakyReLU(0.2), nn.Linear(64, 2))
    discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64),
                                  nn.LeakyReLU(0.2), nn.Linear(64, 1))
    criterion = nn.BCEWithLogitsLoss()
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(generator_net.parameters(), lr=2e-4, betas=(0.5, 0.999))
    points = ring(args.iters * args.batch, torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(points), batch_size=args.batch, shuffle=True,
                        generator=torch.Generator().manual_seed(4))
    fixed_noise = torch.randn(16, args.latent)

    for iteration, (real,) in enumerate(loader):
        ones = torch.ones(real.size(0), 1)
        zeros = torch.zeros(real.size(0), 1)
        # Discriminator: real against detached fakes.
        discriminator.zero_grad()
        loss_real = criterion(discriminator(real), ones)
        fake = generator_net(torch.randn(real.size(0), args.latent))
        loss_fake = criterion(discriminator(fake.detach()), zeros)
        loss_d = loss_real + loss_fake
        if iteration == args.fail_at:
            raise RuntimeError(f"the discriminator diverged at iteration {iteration}")
        loss_d.backward()
        opt_d.step()
        # Generator: through the discriminator, which it tries to fool.
        generator_net.zero_grad()
        loss_g = criterion(discriminator(fake), ones)
        loss_g.backward()
        opt_g.step()
        if iteration % 10 == 0:
            with torch.no_grad():
                spread = generator_net(fixed_noise).norm(dim=1).mean().item()
            print(f"[{iteration}/{len(loader)}] loss_D {loss_d.item():.4f} loss_G {loss_g.item():.4f} "
                  f"radius {spread:.3f}")
    torch.save(generator_net.state_dict(), os.path.join(args.out, "generator.pt"))
    torch.save(discriminator.state_dict(), os.path.join(args.out, "discriminator.pt"))
    print(f"updates {len(loader)}")


if __name__ == "__main__":
    main()
