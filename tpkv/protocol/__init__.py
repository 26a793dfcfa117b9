"""What crosses between the controller and the ranks; both sides import only this package."""
