"""`cmoe calibrate`: what is measured on the device (`measure`, `measure_model`) and how a
hardware profile is fitted from it (`profile_fit`, pure)."""
