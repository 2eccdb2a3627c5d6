#!/usr/bin/env python3
"""Fits the polynomial coefficients of the CPU backend's vector exp and erf
(common/backend/cpu/cpu_kern_simd.h) and prints them with the error each reaches.

  python3 tools/fit_cpu_erf.py          (numpy + mpmath, both installed with torch)

Weighted least squares on Chebyshev nodes against 40-digit mpmath values:
  exp:  e^r on |r| <= ln2/2, degree 6, minimising relative error;
  erf:  |x| < 0.875:  erf(x) = x * P(x^2), degree 5 in x^2, relative error;
        0.875 <= |x| < 3.93:  erf(x) = 1 - e^(-x^2) * R(t), t = 1/(1+|x|), degree 8, with R
        fitted to erfc(x) e^(x^2) in relative error; beyond 3.93 erf rounds to +-1 in fp32.
The "fp32" errors evaluate the polynomials in float32 Horner form, as the kernels do.
"""
import mpmath as mp
import numpy as np

mp.mp.dps = 40


def cheb(a, b, n):
    k = np.arange(n)
    return (a + b) / 2 + (b - a) / 2 * np.cos((2 * k + 1) * np.pi / (2 * n))


def fit(xs, basis, target, deg):
    V = np.vander(basis, deg + 1, increasing=True)
    c, *_ = np.linalg.lstsq(V / target[:, None], np.ones_like(target), rcond=None)
    return c


def horner32(c, v):
    v = v.astype(np.float32)
    p = np.float32(c[-1])
    for cc in c[-2::-1]:
        p = (p * v + np.float32(cc)).astype(np.float32)
    return p.astype(np.float64)


def main():
    a = float(mp.log(2) / 2)
    r = cheb(-a, a, 800)
    c = fit(r, r, np.exp(r), 6)
    rt = np.linspace(-a, a, 100001)
    print("exp degree 6:", [float(x) for x in c])
    print("  relative error %.3g (fp32 Horner %.3g)" % (np.max(np.abs(np.polyval(c[::-1], rt) / np.exp(rt) - 1)),
                                                        np.max(np.abs(horner32(c, rt) / np.exp(rt) - 1))))

    A, B = 0.875, 3.93
    xs = np.abs(cheb(0, A, 400))
    f = np.array([float(mp.erf(mp.mpf(x)) / mp.mpf(x)) for x in xs])
    c1 = fit(xs, xs ** 2, f, 5)
    xt = np.linspace(1e-6, A, 5001)
    ref = np.array([float(mp.erf(mp.mpf(x))) for x in xt])
    y = xt.astype(np.float32).astype(np.float64) * horner32(c1, (xt.astype(np.float32) ** 2))
    print("erf small, degree 5 in x^2:", [float(x) for x in c1])
    print("  relative error (fp32) %.3g" % np.max(np.abs(y - ref) / ref))

    xs = cheb(A, B, 600)
    R = np.array([float(mp.erfc(mp.mpf(x)) * mp.exp(mp.mpf(x) ** 2)) for x in xs])
    c2 = fit(xs, 1 / (1 + xs), R, 8)
    xt = np.linspace(A, B, 5001)
    ref = np.array([float(mp.erf(mp.mpf(x))) for x in xt])
    e = np.exp(-(xt ** 2))
    y = 1 - e * horner32(c2, 1 / (1 + xt))
    print("erf large, degree 8 in 1/(1+x):", [float(x) for x in c2])
    print("  absolute error %.3g" % np.max(np.abs(y - ref)))


if __name__ == "__main__":
    main()
